"""Each GPU's publish shape now: the wished ``dra.publish`` mode, once the GPU can take it.

The config says how a GPU *should* be published (``agent.core.ownership.publish``). What DRA
publishes and prepares is the GPU's *shape* (:class:`~agent.dra.devices.GpuShape`), decided here,
in one place that the ResourceSlice publisher, claim preparation and the health stream all read:

* **What the GPU and the cluster allow.** ``dynamic-mig`` needs a GPU in MIG mode with MIG
  profiles (the agent never switches MIG mode: that needs no process on the GPU and, on many
  models, a reset), and an API server that keeps counters; ``shared`` needs a GPU not in MIG
  mode, at least two memory steps of memory, an API server that keeps consumable capacity, and
  MPS where ``dra.sharing.mps`` asks for it. Where one is missing the GPU is published ``whole``
  and its note says why (``/debug/state``, ``gpu-agent status``, readiness).
* **Waiting for claims.** A GPU takes a new shape only when every claim prepared on it (or
  being prepared) holds a device the new shape still has, with the same meaning: the same name,
  the same MIG placement, a share again a share. Until then the GPU has *no* shape: nothing of
  it is published, so no new claim lands on it, and its note names the claims it waits for —
  as an ownership handover waits. ``whole`` to ``dynamic-mig`` with whole-GPU claims prepared
  does not wait on a GPU not in MIG mode (the whole GPU stays what it was); ``dynamic-mig`` to
  ``whole`` waits for every MIG instance the agent made there.

The decision is a pure function of (wished modes, inventory, what is held, what the API keeps);
:class:`ModeGate` caches it and announces changes on :attr:`ModeGate.changes`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from agent.base.feeds import Broadcast, Subscription
from agent.core.config.schema import PublishMode, SharingConfig
from agent.core.inventory.current import InventoryState
from agent.core.inventory.model import Gpu, Inventory, MigPlacement
from agent.core.ownership.publish import PublishState, PublishTable
from agent.dra.claims.checkpoint import CreatedInstance, PreparedDevice
from agent.dra.devices import (
    DraDevice,
    GpuShape,
    can_partition,
    counter_sets,
    dra_devices,
    share_policy,
)
from agent.dra.partitions import CounterSet

log = structlog.get_logger("agent.dra")

#: claims named in a waiting note (the rest are counted)
SHOWN_CLAIMS = 3


@dataclass(frozen=True, slots=True)
class Held:
    """One device a prepared claim, or a claim being prepared, holds."""

    #: the claim as a note names it (namespace/name, or its UID)
    claim: str
    gpu_uuid: str
    name: str
    placement: MigPlacement | None = None
    share: bool = False
    mps: bool = False

    @classmethod
    def of(cls, claim: str, device: PreparedDevice) -> Held:
        return cls(claim, device.gpu_uuid, device.name, device.placement, device.is_share, device.mps)

    @classmethod
    def planned(cls, claim: str, device: DraDevice) -> Held:
        placement = device.partition.placement if device.partition is not None else None
        mps = device.share.mps if device.share is not None else False
        return cls(claim, device.gpu_uuid, device.name, placement, device.share is not None, mps)


@dataclass(frozen=True, slots=True)
class ApiSupport:
    """What the API server keeps of the fields partitioning needs (None: not known yet)."""

    counters: bool | None = None
    shared: bool | None = None
    #: why not, e.g. "resource.k8s.io/v1beta1 has no counters"
    reason: str = ""


@dataclass(frozen=True, slots=True)
class GpuMode:
    """One GPU's publish mode as ``/debug/state`` shows it."""

    desired: PublishMode
    #: the mode it is published in now; None while it waits for claims to change mode
    effective: PublishMode | None
    #: why it is not published as wished ("" when it is)
    note: str = ""
    #: the claims a mode change waits for
    waiting_for: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        if self.effective is None:
            return f"changing->{self.desired.value}"
        return self.effective.value

    def as_dict(self) -> dict[str, object]:
        return {
            "desired": self.desired.value,
            "effective": self.effective.value if self.effective is not None else None,
            "state": self.label,
            "note": self.note,
            "waiting_for": list(self.waiting_for),
        }


@dataclass(frozen=True, slots=True)
class Shapes:
    """The decision for every GPU of one inventory."""

    shapes: Mapping[str, GpuShape | None] = field(default_factory=dict)
    modes: Mapping[str, GpuMode] = field(default_factory=dict)


def decide(
    inventory: Inventory,
    table: PublishTable,
    held: Iterable[Held],
    instances: Iterable[CreatedInstance],
    *,
    support: ApiSupport = ApiSupport(),
    mps_unavailable: str = "",
) -> Shapes:
    """Each GPU's shape (None: changing mode, waiting for claims) and its mode for display. Pure."""
    by_gpu: dict[str, list[Held]] = {}
    for h in held:
        by_gpu.setdefault(h.gpu_uuid, []).append(h)
    ours = {i.uuid for i in instances if i.uuid is not None}
    creating = {(i.gpu_uuid, i.placement) for i in instances if i.uuid is None}
    shapes: dict[str, GpuShape | None] = {}
    modes: dict[str, GpuMode] = {}
    for gpu in inventory.gpus:
        want = table.mode_of(gpu.uuid)
        shape, note = _shape(gpu, want, table.sharing, support, mps_unavailable, ours, creating)
        holding = by_gpu.get(gpu.uuid, [])
        if holding:
            devices = {d.name: d for d in dra_devices(_only(inventory, gpu), {gpu.uuid: shape})}
            misfits = [h for h in holding if not _fits(h, devices)]
            if misfits:
                claims = tuple(dict.fromkeys(h.claim for h in misfits))
                shown = ", ".join(claims[:SHOWN_CLAIMS]) + (
                    f" and {len(claims) - SHOWN_CLAIMS} more" if len(claims) > SHOWN_CLAIMS else ""
                )
                shapes[gpu.uuid] = None
                modes[gpu.uuid] = GpuMode(
                    want, None, f"changing to {shape.mode.value}: unpublished until claim {shown} is unprepared", claims
                )
                continue
        shapes[gpu.uuid] = shape
        modes[gpu.uuid] = GpuMode(want, shape.mode, note)
    return Shapes(shapes=shapes, modes=modes)


def _only(inventory: Inventory, gpu: Gpu) -> Inventory:
    return Inventory(
        backend=inventory.backend,
        driver_version=inventory.driver_version,
        cuda_driver_version=inventory.cuda_driver_version,
        gpus=(gpu,),
    )


def _fits(held: Held, devices: Mapping[str, DraDevice]) -> bool:
    device = devices.get(held.name)
    if device is None or device.gpu_uuid != held.gpu_uuid:
        return False
    placement = device.partition.placement if device.partition is not None else None
    if placement != held.placement or (device.share is not None) != held.share:
        return False
    return device.share is None or device.share.mps == held.mps


def _shape(
    gpu: Gpu,
    want: PublishMode,
    sharing: SharingConfig,
    support: ApiSupport,
    mps_unavailable: str,
    ours: set[str],
    creating: set[tuple[str, MigPlacement]],
) -> tuple[GpuShape, str]:
    mine = frozenset(m.uuid for m in gpu.mig_devices if m.uuid in ours or (gpu.uuid, m.placement) in creating)
    whole = GpuShape(PublishMode.WHOLE, ours=mine)
    if want is PublishMode.DYNAMIC_MIG:
        why = can_partition(gpu)
        if not why and support.counters is False:
            why = f"the API server does not keep device counters ({support.reason})"
        if why:
            return whole, f"dynamic-mig not possible: {why}; published whole"
        full = MigPlacement(0, gpu.mig_memory_slices)
        blocked = tuple(m.placement or full for m in gpu.mig_devices if m.uuid not in mine)
        note = ""
        if blocked:
            note = (
                f"{len(blocked)} MIG instance(s) the agent did not make are offered as they are; "
                "the placements they take, and the whole GPU, are not"
            )
        return GpuShape(PublishMode.DYNAMIC_MIG, blocked=blocked, ours=mine), note
    if want is PublishMode.SHARED:
        why = ""
        policy = share_policy(
            gpu, default_mib=sharing.default_memory_mib, step_mib=sharing.memory_step_mib, mps=sharing.mps
        )
        if gpu.mig_enabled:
            why = "the GPU is in MIG mode (share its MIG devices through dynamic-mig instead)"
        elif support.shared is False:
            why = f"the API server does not keep consumable capacity ({support.reason})"
        elif policy is None:
            why = f"the GPU has less memory than two shares of dra.sharing.memory_step_mib ({sharing.memory_step_mib})"
        elif sharing.mps and mps_unavailable:
            why = f"dra.sharing.mps asks for MPS, which is not available: {mps_unavailable}"
        if why:
            return whole, f"shared not possible: {why}; published whole"
        return GpuShape(PublishMode.SHARED, share=policy), ""
    return whole, ""


class ModeGate:
    """The shapes of the node's GPUs, recomputed when their inputs change; read by everyone in DRA."""

    def __init__(
        self, *, inventory: InventoryState, publish: PublishState | None = None, mps_unavailable: str = ""
    ) -> None:
        self._inventory = inventory
        self._publish = publish or PublishState()
        self._held: Callable[[], Iterable[Held]] = tuple
        self._instances: Callable[[], Iterable[CreatedInstance]] = tuple
        self._version: Callable[[], object] = lambda: 0
        self._mps_unavailable = mps_unavailable
        self._support = ApiSupport()
        self._key: tuple[object, ...] = ()
        self._decided = Shapes()
        #: the shapes last announced on :attr:`changes`
        self._announced: Mapping[str, GpuShape | None] = {}
        self._announced_modes: Mapping[str, GpuMode] = {}
        self._devices: list[DraDevice] = []
        self._by_name: dict[str, DraDevice] = {}
        self._counters: list[CounterSet] = []
        #: fires when a GPU's shape changes (the publisher and the health stream look again)
        self.changes: Broadcast[None] = Broadcast(maxsize=1)

    def attach(
        self,
        *,
        held: Callable[[], Iterable[Held]],
        instances: Callable[[], Iterable[CreatedInstance]],
        version: Callable[[], object],
    ) -> None:
        """What claims hold, the MIG instances the agent made, and a value that moves when either
        changes: the claim driver's, attached once when it is built."""
        self._held, self._instances, self._version = held, instances, version
        self._key = ()

    # --- reads ----------------------------------------------------------------------------

    def shapes(self) -> Mapping[str, GpuShape | None]:
        return self._current().shapes

    def modes(self) -> Mapping[str, GpuMode]:
        return self._current().modes

    def devices(self) -> list[DraDevice]:
        """The devices of every GPU's shape (GPUs changing mode have none), in publishing order."""
        self._current()
        return self._devices

    def devices_by_name(self) -> Mapping[str, DraDevice]:
        self._current()
        return self._by_name

    def counter_sets(self) -> list[CounterSet]:
        self._current()
        return self._counters

    @property
    def support(self) -> ApiSupport:
        return self._support

    def needs(self) -> tuple[bool, bool]:
        """(some GPU wants counters, some GPU wants shared devices): what the publisher must ask the API about."""
        modes = set(self._publish.current.modes.values())
        return PublishMode.DYNAMIC_MIG in modes, PublishMode.SHARED in modes

    # --- changes --------------------------------------------------------------------------

    def set_support(self, support: ApiSupport) -> None:
        """What the API server keeps (the publisher found out); shapes follow."""
        if support != self._support:
            log.info("dra.api_support", counters=support.counters, shared=support.shared, reason=support.reason or None)
            self._support = support
            self.refresh()

    def refresh(self) -> bool:
        """Decide again now; announce and return True when any GPU's shape changed."""
        after = self._current()
        for gpu, mode in after.modes.items():
            if self._announced_modes.get(gpu) != mode:
                log.info("dra.publish_mode", gpu=gpu, desired=mode.desired.value, state=mode.label, note=mode.note)
        self._announced_modes = after.modes
        if dict(self._announced) == dict(after.shapes):
            return False
        self._announced = after.shapes
        self.changes.publish(None)
        return True

    async def run(self) -> None:
        """Follow the wished modes and the inventory until cancelled."""
        with self._publish.changes.subscribe() as wished, self._inventory.changes.subscribe() as inventory:
            async with asyncio.TaskGroup() as group:
                for feed in (wished, inventory):
                    group.create_task(self._follow(feed))

    async def _follow(self, feed: Subscription[Any]) -> None:
        async for _ in feed:
            self.refresh()

    # --- the decision ---------------------------------------------------------------------

    def _current(self) -> Shapes:
        inventory, table = self._inventory.current, self._publish.current
        key = (inventory, table, self._version(), self._support)
        if len(key) != len(self._key) or any(a is not b and a != b for a, b in zip(key, self._key, strict=True)):
            instances = list(self._instances())
            decided = decide(
                inventory,
                table,
                self._held(),
                instances,
                support=self._support,
                mps_unavailable=self._mps_unavailable,
            )
            # the devices and counters are a function of the inventory and the shapes alone; a
            # prepare moves the version on every call and seldom changes a shape (building the
            # devices again was two thirds of the refresh that follows every prepare)
            same = bool(self._key) and inventory is self._key[0] and dict(decided.shapes) == dict(self._decided.shapes)
            self._key, self._decided = key, decided
            if not same:
                self._devices = dra_devices(inventory, decided.shapes)
                self._by_name = {d.name: d for d in self._devices}
                self._counters = counter_sets(inventory, decided.shapes)
        return self._decided
