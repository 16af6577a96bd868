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

    def registration_checks(self, node: NodeStatus) -> Sequence[RegistrationCheck]:
        """What it advertises against what the kubelet, the Node or the API shows; cheap, no I/O."""
        ...

    def gpu_details(self) -> Mapping[str, Mapping[str, object]]:
        """Physical GPU UUID -> JSON-ready facts the mechanism adds to the GPU's ``/debug/state``
        entry (DRA: its publish mode, MIG partitions, shares, free counters); cheap, no I/O."""
        ...
