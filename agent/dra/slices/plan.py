"""What this node's ResourceSlices should hold, and the writes that get the API there. Pure.

One pool per node (pool name = node name) with every DRA device whose GPU is granted to DRA
(:func:`desired_slices`, from the devices of each GPU's shape, the granted ownership table and
health), and the counter sets its partitionable devices consume.
A healthy device is published as it is; an unhealthy one (health ``unknown`` counts as not
healthy) is left out, or, where the cluster keeps device taints, published with a
``NoSchedule`` taint ``<driver>/unhealthy`` whose value says why. A pool with no devices has
no slices (a node without DRA GPUs writes nothing).

Slices hold at most 128 devices, 64 when any device carries a taint or consumes counters
(``ResourceSliceMaxDevicesWithAdvancedFeatures``, k8s.io/api ``resource/v1/types.go`` at
v0.36.3); a bigger pool is split into several slices with the same generation and
``resourceSliceCount``. Counter sets go in slices of their own, at most 8 sets each (a slice
holds either devices or counters, ``ResourceSliceMaxCounterSets``), listed before the devices.
:func:`plan` compares the desired pool with the stored slices and returns nothing to do when
they agree (zero writes in steady state); otherwise every slice of the pool is written with
generation ``max(seen) + 1`` and the rest are deleted, as the upstream helper does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agent.core.config.schema import Owner
from agent.core.health.model import HealthState
from agent.core.health.monitor import HealthMonitor
from agent.core.ownership.table import OwnershipTable
from agent.dra.devices import DraDevice, binary_quantity
from agent.dra.partitions import CounterSet, CounterUse

MAX_DEVICES = 128
#: a slice with a tainted device (or counters) holds fewer devices from 1.35
MAX_DEVICES_WITH_TAINTS = 64
#: counter sets in one slice
MAX_COUNTER_SETS = 8
#: the apiserver generates ``<generateName><5 random chars>`` and cuts the prefix at 58
MAX_GENERATE_NAME = 58
NO_SCHEDULE = "NoSchedule"

AttributeValue = int | bool | str


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str
    effect: str = NO_SCHEDULE


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """A capacity's ``requestPolicy``: ``default`` and ``validRange {min, step}`` (quantities)."""

    default: str
    minimum: str
    step: str


@dataclass(frozen=True, slots=True)
class SliceDevice:
    """A device as a slice holds it, comparable whatever API version it was read with."""

    name: str
    #: (key, kind, value), sorted by key
    attributes: tuple[tuple[str, str, AttributeValue], ...] = ()
    #: (key, quantity), sorted by key
    capacity: tuple[tuple[str, str], ...] = ()
    taints: tuple[Taint, ...] = ()
    #: ``consumesCounters``: the counter sets and counters (sorted by name) it takes
    consumes: tuple[CounterUse, ...] = ()
    #: ``allowMultipleAllocations`` (a shared GPU)
    allow_multiple: bool = False
    #: (capacity key, its request policy), sorted by key
    policies: tuple[tuple[str, RequestPolicy], ...] = ()

    @classmethod
    def of(cls, device: DraDevice, taints: tuple[Taint, ...] = ()) -> SliceDevice:
        policies: tuple[tuple[str, RequestPolicy], ...] = ()
        if device.share is not None:
            share = device.share
            step = binary_quantity(share.step)
            policies = (("memory", RequestPolicy(binary_quantity(share.default), step, step)),)
        return cls(
            name=device.name,
            attributes=tuple(sorted((k, a.kind, a.value) for k, a in device.attributes.items())),
            capacity=tuple(sorted(device.capacity.items())),
            taints=taints,
            consumes=tuple(CounterUse(c.counter_set, tuple(sorted(c.counters))) for c in device.consumes),
            allow_multiple=device.share is not None,
            policies=policies,
        )

    @property
    def advanced(self) -> bool:
        """It carries a taint or consumes counters: its slice holds at most 64 devices."""
        return bool(self.taints or self.consumes)

    @property
    def gpu_uuid(self) -> str:
        """The physical GPU this device is on, from its own attributes ("" when it names none)."""
        values = {key: value for key, _, value in self.attributes}
        found = values.get("parentUUID") or values.get("uuid")
        return found if isinstance(found, str) else ""


@dataclass(frozen=True, slots=True)
class StoredSlice:
    """One of our ResourceSlices as the API server holds it."""

    name: str
    uid: str
    resource_version: str
    driver: str
    pool: str
    generation: int
    count: int
    node_name: str
    devices: tuple[SliceDevice, ...]
    #: UID of the controlling owner reference to a Node ("" when there is none)
    owner_uid: str = ""
    #: ``sharedCounters`` (a counter slice holds these and no devices)
    counters: tuple[CounterSet, ...] = ()

    @property
    def gpus(self) -> frozenset[str]:
        return frozenset(d.gpu_uuid for d in self.devices if d.gpu_uuid)

    @property
    def content(self) -> SliceContent:
        return CounterSlice(self.counters) if self.counters else self.devices


@dataclass(frozen=True, slots=True)
class CounterSlice:
    """The content of a slice that holds counter sets (and, as the API wants, no devices)."""

    sets: tuple[CounterSet, ...]


#: what one slice holds: devices, or counter sets
SliceContent = tuple[SliceDevice, ...] | CounterSlice


@dataclass(frozen=True, slots=True)
class Plan:
    """The writes that turn the stored slices into the desired pool; empty when they agree."""

    generation: int = 0
    #: (stored slice, its new content): PUT with the stored resourceVersion
    updates: tuple[tuple[StoredSlice, SliceContent], ...] = ()
    creates: tuple[SliceContent, ...] = ()
    deletes: tuple[StoredSlice, ...] = ()
    #: resourceSliceCount for every written slice
    count: int = 0
    reasons: tuple[str, ...] = field(default_factory=tuple)

    @property
    def empty(self) -> bool:
        return not (self.updates or self.creates or self.deletes)


def taint_key(driver: str) -> str:
    return f"{driver}/unhealthy"


def pool_devices(
    devices: Sequence[DraDevice],
    *,
    granted: Callable[[str], bool],
    unhealthy_cause: Callable[[str], str | None],
    driver: str,
    taints: bool,
) -> tuple[SliceDevice, ...]:
    """The devices of the pool, in ``devices`` order.

    ``granted(gpu_uuid)`` says whether DRA may offer the GPU; ``unhealthy_cause(uuid)`` is None
    for a healthy device and the reason otherwise; ``taints`` whether the cluster keeps taints.
    """
    out: list[SliceDevice] = []
    for device in devices:
        if not granted(device.gpu_uuid):
            continue
        cause = unhealthy_cause(device.uuid)
        if cause is None:
            out.append(SliceDevice.of(device))
        elif taints:
            out.append(SliceDevice.of(device, (Taint(taint_key(driver), label_value(cause)),)))
    return tuple(out)


def desired_slices(
    devices: Sequence[DraDevice],
    *,
    ownership: OwnershipTable,
    health: HealthMonitor,
    driver: str,
    taints: bool | None,
    counter_sets: Sequence[CounterSet] = (),
) -> tuple[SliceContent, ...] | None:
    """The pool's slices: the devices whose GPU is granted to DRA, unhealthy ones left out or
    tainted (``taints``: whether the cluster keeps taints), and the counter sets they consume;
    None while taint support is not known and a device to publish is unhealthy (the caller
    finds out first)."""

    def granted(gpu: str) -> bool:
        return ownership.granted_to(gpu, Owner.DRA)

    def cause(uuid: str) -> str | None:
        return unhealthy_cause(health, uuid)

    if taints is None and any(granted(d.gpu_uuid) and cause(d.uuid) is not None for d in devices):
        return None
    pool = pool_devices(devices, granted=granted, unhealthy_cause=cause, driver=driver, taints=bool(taints))
    used = {use.counter_set for d in pool for use in d.consumes}
    return split(pool, [s for s in counter_sets if s.name in used])


def unhealthy_cause(health: HealthMonitor, uuid: str) -> str | None:
    """None for a healthy device; why it is not, for one that is unhealthy or of unknown health."""
    state = health.state(uuid)
    if state is HealthState.HEALTHY:
        return None
    if state is HealthState.UNKNOWN:
        return "health unknown"
    record = health.record(uuid)
    return (record.cause if record else "") or "unhealthy"


def split(devices: Sequence[SliceDevice], counter_sets: Sequence[CounterSet] = ()) -> tuple[SliceContent, ...]:
    """Counter slices of at most 8 sets, then chunks of at most 128 devices (64 when any is tainted
    or consumes counters); none for an empty pool."""
    size = MAX_DEVICES_WITH_TAINTS if any(d.advanced for d in devices) else MAX_DEVICES
    counters: tuple[SliceContent, ...] = tuple(
        CounterSlice(tuple(counter_sets[i : i + MAX_COUNTER_SETS]))
        for i in range(0, len(counter_sets), MAX_COUNTER_SETS)
    )
    return counters + tuple(tuple(devices[i : i + size]) for i in range(0, len(devices), size))


def plan(
    desired: Sequence[SliceContent],
    stored: Sequence[StoredSlice],
    *,
    node: str,
    driver: str,
    node_uid: str,
    last_generation: int = 0,
) -> Plan:
    """The writes from ``stored`` (our slices as listed) to ``desired`` (from :func:`split`).

    Slices of the current generation are reused (see :func:`_pair`); any other stored slice
    (an older generation, another pool name, left over from a bigger pool) is deleted.
    """
    top = max((s.generation for s in stored), default=0)
    current = sorted((s for s in stored if s.generation == top and s.pool == node), key=lambda s: s.name)
    paired, new = _pair(desired, current)
    reused = {s.name for s, _ in paired}
    leftover = [s for s in stored if s.name not in reused]
    reasons: list[str] = []
    if leftover:
        reasons.append(f"{len(leftover)} obsolete slice(s)")
    if new:
        reasons.append(f"{len(new)} slice(s) missing")
    for s, content in paired:
        if s.content != content:
            reasons.append(f"{'counters' if isinstance(content, CounterSlice) else 'devices'} of {s.name} differ")
        elif s.count != len(desired) or s.owner_uid != node_uid or s.node_name != node or s.driver != driver:
            reasons.append(f"pool fields of {s.name} differ")
    if not reasons:
        return Plan(generation=top, count=len(desired))
    generation = max(top, last_generation) + 1 if desired else top
    return Plan(
        generation=generation,
        updates=tuple(paired),
        creates=new,
        deletes=tuple(leftover),
        count=len(desired),
        reasons=tuple(reasons),
    )


def _pair(
    desired: Sequence[SliceContent], current: list[StoredSlice]
) -> tuple[list[tuple[StoredSlice, SliceContent]], tuple[SliceContent, ...]]:
    """Match desired slices to stored ones: identical content first, then most device (or counter
    set) names in common (slice names are random, so order says nothing); counter slices pair
    with counter slices; the desired slices left over are new."""
    free = list(current)
    matched: dict[int, StoredSlice] = {}
    for i, content in enumerate(desired):
        same = next((s for s in free if s.content == content), None)
        if same is not None:
            matched[i] = same
            free.remove(same)
    for i, content in enumerate(desired):
        kind = [s for s in free if isinstance(s.content, CounterSlice) == isinstance(content, CounterSlice)]
        if i in matched or not kind:
            continue
        names = _names(content)
        best = max(kind, key=lambda s: len(names & _names(s.content)))
        matched[i] = best
        free.remove(best)
    paired = [(matched[i], content) for i, content in enumerate(desired) if i in matched]
    return paired, tuple(content for i, content in enumerate(desired) if i not in matched)


def _names(content: SliceContent) -> set[str]:
    if isinstance(content, CounterSlice):
        return {s.name for s in content.sets}
    return {d.name for d in content}


def generate_name(node: str, driver: str) -> str:
    """``<node>-<driver>-``, cut to the apiserver's 58-character prefix at a clean boundary."""
    base = f"{node}-{driver}"
    if len(base) > MAX_GENERATE_NAME - 1:
        # a label of a DNS subdomain may not end in '-' or '.', and the random suffix follows
        base = base[: MAX_GENERATE_NAME - 1].rstrip(".-")
    return base + "-"


_LABEL_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


def label_value(text: str) -> str:
    """``text`` as a valid label value (taint values are label values): ≤ 63 characters of
    ``[A-Za-z0-9_.-]``, alphanumeric at both ends; "unknown" when nothing is left."""
    value = _LABEL_BAD.sub("-", text)[:63]
    value = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)
    return value or "unknown"
