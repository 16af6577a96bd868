"""What a prepared DRA claim's spec holds beyond the driver's edits: its devices, their extra
environment variables and bind mounts.

A claim's opaque config may ask for environment variables in the containers that get its
devices; a share of a shared GPU adds its own (its MPS limits) and mounts (the MPS daemon's pipe
and log directories). They are written into the claim's transient spec as device-level edits,
after the driver's own. The reconciler rebuilds claim specs from what DRA reports as
prepared, so the extras travel with the claim's devices in :class:`ClaimDevices` and every
writer of a claim spec (prepare, reconcile) applies them the same way.

A claim names a device by its UUID, or, for a share of a shared GPU, by :func:`share_key`: one
CDI device per share, named after its share ID, so two shares of one GPU in one pod never
collide on a CDI name (kubernetes/kubernetes issue 134519).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from agent.cdi import generate
from agent.cdi.generate import GeneratedSpec
from agent.cdi.spec import Mount, check

#: between a device UUID and a share ID in a share's key (and CDI device name)
SHARE_SEPARATOR = generate.SHARE_SEPARATOR


def share_key(uuid: str, share_id: str) -> str:
    """The key (and the tail of the CDI device name) of one share of device ``uuid``."""
    return f"{uuid}{SHARE_SEPARATOR}{share_id}"


def device_of(key: str) -> str:
    """The device UUID a key names (a share's key names its GPU)."""
    return key.partition(SHARE_SEPARATOR)[0]


@dataclass(frozen=True, slots=True)
class ClaimDevices:
    """What one prepared claim's spec holds: device keys (UUIDs or share keys), and per key extra
    ``NAME=VALUE`` entries and (host path, container path) bind mounts."""

    devices: tuple[str, ...]
    env: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    mounts: Mapping[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)


def as_claim_devices(value: Sequence[str] | ClaimDevices) -> ClaimDevices:
    """A plain device list is a claim without extra environment."""
    if isinstance(value, ClaimDevices):
        return value
    return ClaimDevices(devices=tuple(value))


#: options of a share's bind mounts (as NVIDIA's DRA driver mounts the MPS pipe directory)
MOUNT_OPTIONS = ("rw", "nosuid", "nodev", "bind")


def with_env(
    generated: GeneratedSpec,
    env: Mapping[str, Sequence[str]],
    mounts: Mapping[str, Sequence[tuple[str, str]]] | None = None,
) -> GeneratedSpec:
    """``generated`` with each device's extra entries and mounts appended to its edits (pure).

    ``env`` and ``mounts`` are keyed like ``generated.names`` (device key). An entry the device's
    edits already hold is not repeated, so a spec rebuilt from entries read back from disk is
    byte-identical to the one first written.
    """
    spec = generated.spec
    mounts = mounts or {}
    if spec is None or not (any(env.values()) or any(mounts.values())):
        return generated
    by_name = {generated.names[key]: tuple(entries) for key, entries in env.items() if key in generated.names}
    mounts_by_name = {generated.names[key]: tuple(m) for key, m in mounts.items() if key in generated.names}
    devices = []
    for device in spec.devices:
        edits = device.container_edits
        extra = [e for e in by_name.get(device.name, ()) if e not in edits.env]
        binds = [
            Mount(host_path=host, container_path=container, options=MOUNT_OPTIONS)
            for host, container in mounts_by_name.get(device.name, ())
            if not any(m.container_path == container for m in edits.mounts)
        ]
        if extra or binds:
            edits = replace(edits, env=(*edits.env, *extra), mounts=(*edits.mounts, *binds))
            device = replace(device, container_edits=edits)
        devices.append(device)
    return replace(generated, spec=check(replace(spec, devices=tuple(devices))))
