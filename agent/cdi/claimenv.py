"""Extra environment variables that a prepared DRA claim adds to its devices.

A claim's opaque config may ask for environment variables in the containers that get its
devices; they are written into the claim's transient spec as device-level ``env`` edits,
after the driver's own. The reconciler rebuilds claim specs from what DRA reports as
prepared, so the extra variables travel with the claim's devices in :class:`ClaimDevices`
and every writer of a claim spec (prepare, reconcile) applies them the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from agent.cdi.generate import GeneratedSpec
from agent.cdi.spec import check


@dataclass(frozen=True, slots=True)
class ClaimDevices:
    """What one prepared claim's spec holds: device UUIDs, and per device extra ``NAME=VALUE`` entries."""

    devices: tuple[str, ...]
    env: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def as_claim_devices(value: Sequence[str] | ClaimDevices) -> ClaimDevices:
    """A plain device list is a claim without extra environment."""
    if isinstance(value, ClaimDevices):
        return value
    return ClaimDevices(devices=tuple(value))


def with_env(generated: GeneratedSpec, env: Mapping[str, Sequence[str]]) -> GeneratedSpec:
    """``generated`` with each device's extra entries appended to its edits (pure).

    ``env`` is keyed like ``generated.names`` (device UUID). An entry the device's edits
    already hold is not repeated, so a spec rebuilt from entries read back from disk is
    byte-identical to the one first written.
    """
    spec = generated.spec
    if spec is None or not any(env.values()):
        return generated
    by_name = {generated.names[uuid]: tuple(entries) for uuid, entries in env.items() if uuid in generated.names}
    devices = []
    for device in spec.devices:
        extra = [e for e in by_name.get(device.name, ()) if e not in device.container_edits.env]
        if extra:
            edits = replace(device.container_edits, env=(*device.container_edits.env, *extra))
            device = replace(device, container_edits=edits)
        devices.append(device)
    return replace(generated, spec=check(replace(spec, devices=tuple(devices))))
