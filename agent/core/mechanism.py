"""What the composition root and the debug endpoint know of a device mechanism.

The device plugin (``agent/plugin``) and DRA (``agent/dra``) each implement
:class:`Mechanism`; ``agent/runtime/app.py`` runs them and ``agent/observe/debug/document.py`` shows them through
this interface only, so nothing outside a mechanism's package names its internals.

Terms used by both mechanisms:

* a mechanism *advertises* a physical GPU when the kubelet or the scheduler can currently
  hand it (or a MIG device or replica of it) to a new workload: the device plugin lists it in
  ListAndWatch, DRA publishes it in a ResourceSlice;
* a GPU is *in use* through a mechanism while something it handed out still holds it: a
  container the kubelet allocated it to (device plugin, known from PodResources), a prepared
  claim (DRA, known from the checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from agent.core.config.schema import Owner


@dataclass(frozen=True, slots=True)
class Readiness:
    """One readiness check: whether it passes, and a detail saying why not (or a note)."""

    ok: bool
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Holder:
    """Something that holds a GPU through a mechanism: a pod's container, or a claim."""

    #: "container" (device plugin) or "claim" (DRA)
    kind: str
    namespace: str
    name: str
    uid: str = ""
    #: the container name (device plugin) or the pods the claim is reserved for (DRA), if known
    detail: str = ""
    #: the device IDs the holder got (plugin IDs, or DRA device names)
    devices: tuple[str, ...] = ()
    #: when the mechanism first saw this holder (ISO 8601 UTC), if it knows
    since: str = ""

    def as_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "namespace": self.namespace,
            "name": self.name,
            "uid": self.uid,
            "detail": self.detail,
            "devices": list(self.devices),
            "since": self.since,
        }


@dataclass(frozen=True, slots=True)
class Usage:
    """Which physical GPUs are in use through one mechanism, as far as it can tell.

    ``known`` is False when the mechanism cannot currently find out (the kubelet's
    PodResources socket is missing or failing): then no GPU may be taken for idle, and
    ``reason`` says why.
    """

    known: bool
    #: physical GPU UUID -> who holds it; GPUs not listed are idle (when ``known``)
    holders: Mapping[str, tuple[Holder, ...]] = field(default_factory=dict)
    reason: str = ""
    #: monotonic time the observation was made (a PodResources answer is as old as its poll);
    #: a drain trusts only observations made after the GPU stopped being advertised
    as_of: float = 0.0

    def in_use(self, gpu_uuid: str) -> bool:
        return bool(self.holders.get(gpu_uuid))


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """What the API server says about this Node, for the registration watchdog."""

    #: extended resource name -> ``status.allocatable`` count (None: not read, see ``reason``)
    allocatable: Mapping[str, int] | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SchedulerView:
    """Which GPUs a mechanism still serves that the scheduler no longer counts on.

    The scheduler places device-plugin pods by the Node's ``status.allocatable``, which the
    kubelet updates only at its next status sync (10 s), while ResourceSlices it reads directly.
    So the device plugin keeps serving a GPU it is to give up until the scheduler's view of the
    Node no longer counts it (a *closing* drain), and only then stops listing it.
    """

    #: GPUs whose withdrawal the scheduler already sees; None: it sees them at once (DRA)
    closed: frozenset[str] | None = None
    #: why the others are not closed yet
    note: str = ""


@dataclass(frozen=True, slots=True)
class NodeCeiling:
    """The most one extended resource may show in the Node's status: what the device plugin lists
    (``capacity``) and lists healthy (``allocatable``), less the GPUs it is giving up."""

    capacity: int
    allocatable: int


class NodeCounts(Protocol):
    """Keeps the Node's counts of the device plugin's resources at or below their ceilings.

    The real one (``agent/kube/nodecounts.py``) lowers them with a ``nodes/status`` patch and
    watches that the kubelet does not raise them again from a view that still counts a GPU on its
    way out; :class:`NoNodeCounts` without API access.
    """

    def lower_to(self, ceilings: Mapping[str, NodeCeiling]) -> None:
        """The ceilings now (resource name -> ceiling); no I/O."""
        ...

    def held_since(self, resource: str) -> float | None:
        """Monotonic time since which the Node has shown ``resource`` at or below its ceiling,
        without a break; None while it does not (or is not known to)."""
        ...

    def debug_state(self) -> dict[str, object]: ...


class NoNodeCounts:
    """No API access: the scheduler's view cannot be changed, so it is taken as changed at once."""

    def lower_to(self, ceilings: Mapping[str, NodeCeiling]) -> None:
        return None

    def held_since(self, resource: str) -> float | None:
        return float("-inf")

    def debug_state(self) -> dict[str, object]:
        return {"enabled": False}


@dataclass(frozen=True, slots=True)
class RegistrationCheck:
    """One comparison of what a mechanism advertises with what the node shows.

    The watchdog (``agent/observe/watchdog.py``) tracks checks by ``key`` across rounds and calls
    ``repair`` when one disagrees for longer than the kubelet needs to catch up.
    """

    #: stable name, e.g. ``nvidia.com/gpu kubelet-allocatable`` (a metric label: few values)
    key: str
    #: devices we advertise to that peer
    advertised: int
    #: devices the peer shows (None: it cannot be read now; the check is skipped)
    seen: int | None
    #: whether the two agree (the same count can still name different devices)
    agrees: bool
    #: what differs, for logs and readiness
    detail: str
    #: make the mechanism advertise again through its own path (re-register, re-publish)
    repair: Callable[[str], None]


class Mechanism(Protocol):
    """One way of handing GPUs to workloads, run by the agent as a root task."""

    #: the owner value this mechanism serves (``device-plugin`` or ``dra``)
    owner: Owner

    async def run(self) -> None:
        """Serve until cancelled; clean up (sockets, streams) on the way out. Never returns."""
        ...

    def readiness(self) -> Readiness:
        """Whether the mechanism is serving what it should; cheap, no I/O that can block."""
        ...

    def debug_state(self) -> dict[str, object]:
        """A JSON-ready view for ``/debug/state``."""
        ...

    def advertised_gpus(self) -> frozenset[str]:
        """Physical GPU UUIDs the mechanism currently offers to new workloads."""
        ...

    def usage(self) -> Usage:
        """Which GPUs are in use through this mechanism (see :class:`Usage`)."""
        ...

    def scheduler_view(self) -> SchedulerView:
        """Which GPUs it still serves that the scheduler no longer counts on (see :class:`SchedulerView`)."""
        ...

    def registration_checks(self, node: NodeStatus) -> Sequence[RegistrationCheck]:
        """What it advertises against what the kubelet, the Node or the API shows; cheap, no I/O."""
        ...

    def gpu_details(self) -> Mapping[str, Mapping[str, object]]:
        """Physical GPU UUID -> JSON-ready facts the mechanism adds to the GPU's ``/debug/state``
        entry (DRA: its publish mode, MIG partitions, shares, free counters); cheap, no I/O."""
        ...
