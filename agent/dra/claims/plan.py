"""What preparing a claim on this node means, decided without side effects.

:func:`plan_claim` turns the ResourceClaim the API server returned into the devices to
prepare, or the one :class:`~agent.dra.claims.errors.ClaimError` that stops it. It checks, in this
order: the claim exists, its UID is the one the kubelet asked for (a claim deleted and
re-created under the same name is another claim), it is allocated, it has results of this
driver, each of them is in this node's pool, names a device of this node, whose GPU is
granted to DRA (or still draining away from it: the scheduler allocated it from a slice that
still listed it, and the drain waits for the claim) and healthy (unknown health is not
healthy), and this driver's opaque configs parse. Whether a device is free is not decided
here: that needs the prepared claims and the batch in flight (see :mod:`agent.dra.claims.driver`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.core.health.model import HealthState
from agent.core.health.monitor import HealthMonitor
from agent.core.ownership.table import OwnershipTable
from agent.dra.claims.errors import ClaimError, Reason, quote
from agent.dra.claims.gpuconfig import driver_configs, env_for
from agent.dra.devices import DraDevice
from agent.kube.claims.model import ClaimRef, DeviceResult, ResourceClaim

#: the API allows 32 results per claim; more is not a claim this driver can trust
MAX_RESULTS = 128


@dataclass(frozen=True, slots=True)
class PlannedDevice:
    result: DeviceResult
    device: DraDevice
    env: Mapping[str, str] = field(default_factory=dict)


def plan_claim(
    ref: ClaimRef,
    claim: ResourceClaim | None,
    *,
    driver: str,
    pool: str,
    devices: Mapping[str, DraDevice],
    ownership: OwnershipTable,
    health: HealthMonitor,
) -> list[PlannedDevice]:
    """The devices to prepare for ``ref``, one per allocation result of this driver, in order."""
    if claim is None:
        raise ClaimError(Reason.CLAIM_NOT_FOUND, f"ResourceClaim {ref.namespace}/{ref.name} not found")
    if claim.uid != ref.uid:
        raise ClaimError(
            Reason.UID_MISMATCH,
            f"ResourceClaim {ref.namespace}/{ref.name} has UID {quote(claim.uid)}, the kubelet asked for "
            f"{quote(ref.uid)} (deleted and re-created?)",
        )
    if not claim.allocated:
        raise ClaimError(Reason.NOT_ALLOCATED, f"ResourceClaim {ref.namespace}/{ref.name} is not allocated")
    ours = [r for r in claim.results if r.driver == driver]
    if not ours:
        drivers = sorted({r.driver for r in claim.results})
        raise ClaimError(
            Reason.NOT_HERE,
            f"ResourceClaim {ref.namespace}/{ref.name} has no device of driver {driver} "
            f"(allocated from: {quote(', '.join(drivers) or 'nothing')})",
        )
    if len(ours) > MAX_RESULTS:
        raise ClaimError(Reason.NOT_HERE, f"{len(ours)} allocation results for this driver, at most {MAX_RESULTS}")
    planned = [
        _check(result, driver=driver, pool=pool, devices=devices, ownership=ownership, health=health) for result in ours
    ]
    configs = driver_configs(claim.configs, driver)
    planned = [PlannedDevice(p.result, p.device, env_for(configs, p.result.request)) for p in planned]
    _check_env_agrees(planned)
    return planned


def _check(
    result: DeviceResult,
    *,
    driver: str,
    pool: str,
    devices: Mapping[str, DraDevice],
    ownership: OwnershipTable,
    health: HealthMonitor,
) -> PlannedDevice:
    where = f"device {quote(result.device)} (request {quote(result.request)})"
    if result.pool != pool:
        raise ClaimError(Reason.NOT_HERE, f"{where} is in pool {quote(result.pool)}, not in this node's pool {pool!r}")
    device = devices.get(result.device)
    if device is None:
        raise ClaimError(Reason.DEVICE_UNKNOWN, f"{where}: no such device of driver {driver} on this node")
    if not ownership.dra_may_prepare(device.uuid):
        owner = ownership.state_of(device.uuid)
        raise ClaimError(
            Reason.NOT_DRA_OWNED, f"{where}: GPU {device.gpu_uuid} is not given to DRA on this node (owner: {owner})"
        )
    state = health.state(device.uuid)
    if state is not HealthState.HEALTHY:
        record = health.record(device.uuid)
        cause = record.cause if record is not None and record.cause else "no health record"
        raise ClaimError(Reason.UNHEALTHY, f"{where}: GPU {device.gpu_uuid} is {state.value} ({cause})")
    return PlannedDevice(result=result, device=device)


def _check_env_agrees(planned: list[PlannedDevice]) -> None:
    """Two results naming one device (shared devices) get one CDI device: their env must agree."""
    seen: dict[str, PlannedDevice] = {}
    for item in planned:
        first = seen.setdefault(item.device.uuid, item)
        if first.env != item.env:
            raise ClaimError(
                Reason.BAD_CONFIG,
                f"device {item.device.name} serves requests {quote(first.result.request)} and "
                f"{quote(item.result.request)}, whose configs set different environments",
                recoverable=False,
            )
