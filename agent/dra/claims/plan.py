"""What preparing a claim on this node means, decided without side effects.

:func:`plan_claim` turns the ResourceClaim the API server returned into the devices to
prepare, or the one :class:`~agent.dra.claims.errors.ClaimError` that stops it. It checks, in this
order: the claim exists, its UID is the one the kubelet asked for (a claim deleted and
re-created under the same name is another claim), it is allocated, it has results of this
driver, each of them is in this node's pool, names a device this node publishes now (a GPU
changing its publish mode publishes none), whose GPU is granted to DRA (or still draining away
from it: the scheduler allocated it from a slice that still listed it, and the drain waits for
the claim) and healthy (unknown health is not healthy), a share of a shared GPU has its share ID
and the memory the scheduler allocated it (``consumedCapacity``), and this driver's opaque
configs parse. Whether a device is free is not decided here: that needs the prepared claims and
the batch in flight (see :mod:`agent.dra.claims.driver`).

What a device becomes is the device's business: a partition (or the whole GPU of a GPU in MIG
mode) is a MIG instance to make (:attr:`DraDevice.partition`), a share is one CDI device of its
own (:attr:`PlannedDevice.cdi_key`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from agent.cdi.claimenv import share_key
from agent.core.health.model import HealthState
from agent.core.health.monitor import HealthMonitor
from agent.core.ownership.table import OwnershipTable
from agent.dra.claims.errors import ClaimError, Reason, quote
from agent.dra.claims.gpuconfig import driver_configs, env_for
from agent.dra.devices import DraDevice
from agent.kube.claims.model import ClaimRef, DeviceResult, ResourceClaim
from agent.kube.quantity import parse_bytes

#: the API allows 32 results per claim; more is not a claim this driver can trust
MAX_RESULTS = 128
#: a share ID becomes part of a CDI device name: the scheduler writes a UUID
_SHARE_ID = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,62}[A-Za-z0-9])?")


@dataclass(frozen=True, slots=True)
class PlannedDevice:
    result: DeviceResult
    device: DraDevice
    env: Mapping[str, str] = field(default_factory=dict)
    #: a share of a shared GPU: the memory the scheduler allocated it, in bytes
    share_memory: int | None = None

    @property
    def cdi_key(self) -> str:
        """The device the claim's CDI spec names for this result: a share has one of its own.

        A partition's is its parent until the instance is made (:class:`~agent.dra.claims.pending.PendingClaim`
        then names the instance).
        """
        if self.share_memory is not None and self.result.share_id:
            return share_key(self.device.uuid, self.result.share_id)
        return self.device.uuid


def plan_claim(
    ref: ClaimRef,
    claim: ResourceClaim | None,
    *,
    driver: str,
    pool: str,
    devices: Mapping[str, DraDevice],
    ownership: OwnershipTable,
    health: HealthMonitor,
    why_missing: Callable[[str], str] = lambda name: "",
) -> list[PlannedDevice]:
    """The devices to prepare for ``ref``, one per allocation result of this driver, in order.

    ``why_missing(device name)`` explains a name this node does not publish now ("" if it cannot).
    """
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
        _check(
            result,
            driver=driver,
            pool=pool,
            devices=devices,
            ownership=ownership,
            health=health,
            why_missing=why_missing,
        )
        for result in ours
    ]
    configs = driver_configs(claim.configs, driver)
    planned = [PlannedDevice(p.result, p.device, env_for(configs, p.result.request), p.share_memory) for p in planned]
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
    why_missing: Callable[[str], str],
) -> PlannedDevice:
    where = f"device {quote(result.device)} (request {quote(result.request)})"
    if result.pool != pool:
        raise ClaimError(Reason.NOT_HERE, f"{where} is in pool {quote(result.pool)}, not in this node's pool {pool!r}")
    device = devices.get(result.device)
    if device is None:
        why = why_missing(result.device)
        raise ClaimError(
            Reason.DEVICE_UNKNOWN,
            f"{where}: no such device of driver {driver} on this node" + (f" ({why})" if why else ""),
        )
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
    if device.share is None:
        return PlannedDevice(result=result, device=device)
    return PlannedDevice(result=result, device=device, share_memory=_share_memory(result, device, where))


def _share_memory(result: DeviceResult, device: DraDevice, where: str) -> int:
    """The memory the scheduler allocated a share of ``device`` (bytes); ClaimError when it did not say."""
    assert device.share is not None
    if not result.share_id or not _SHARE_ID.fullmatch(result.share_id):
        raise ClaimError(
            Reason.BAD_REQUEST,
            f"{where}: a shared device's allocation needs a share ID of letters, digits and '-' "
            f"(got {quote(result.share_id)}; is DRAConsumableCapacity on in the scheduler?)",
            recoverable=False,
        )
    text = result.consumed.get("memory")
    if text is None:
        raise ClaimError(
            Reason.BAD_REQUEST,
            f"{where}: the allocation of a shared device says nothing of its consumedCapacity.memory "
            "(is DRAConsumableCapacity on in the scheduler?)",
            recoverable=False,
        )
    try:
        memory = parse_bytes(text)
    except ValueError as exc:
        raise ClaimError(Reason.BAD_REQUEST, f"{where}: consumedCapacity.memory: {exc}", recoverable=False) from exc
    if not 0 < memory <= device.share.memory:
        raise ClaimError(
            Reason.BAD_REQUEST,
            f"{where}: consumedCapacity.memory {quote(text)} is not a share of the GPU's {device.share.memory} bytes",
            recoverable=False,
        )
    return memory


def _check_env_agrees(planned: list[PlannedDevice]) -> None:
    """Two results naming one device (admin access next to a claim's own) get one CDI device:
    their env must agree. Shares are CDI devices of their own."""
    seen: dict[str, PlannedDevice] = {}
    for item in planned:
        first = seen.setdefault(item.cdi_key, item)
        if first.env != item.env:
            raise ClaimError(
                Reason.BAD_CONFIG,
                f"device {item.device.name} serves requests {quote(first.result.request)} and "
                f"{quote(item.result.request)}, whose configs set different environments",
                recoverable=False,
            )
