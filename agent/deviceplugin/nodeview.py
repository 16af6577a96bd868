"""What the scheduler may count of the device plugin's resources, and when a GPU has left its view.

The scheduler places a pod that asks for ``nvidia.com/gpu`` by the Node's ``status.allocatable``
(and, from Kubernetes 1.34 with an extended-resource DeviceClass, sends it to DRA only where that
count is 0). The kubelet writes that count at its next node status sync, up to 10 s after the
device plugin's list changed, so a GPU the plugin stops listing stays in the scheduler's view
for that long, and every pod bound to it meanwhile is turned away at admission
(``UnexpectedAdmissionError``, never retried).

So a GPU the device plugin gives up *closes* first (:class:`~agent.core.ownership.table.Drain`
``closing``): the plugin keeps listing it and answering Allocate for it, while
:func:`node_ceilings`, which leave it out, are brought to the Node (``agent/kube/nodecounts.py``:
a ``nodes/status`` patch). :func:`closed_gpus` says when it may go: the Node has shown every
resource that lists it at or below its ceiling for :data:`GRACE_S` without a break — long
enough for the kubelet to admit the pods the scheduler bound before it saw the lower count,
and to give them a GPU it still lists. A gate that cannot lower the Node (the API refuses the
patch) gives up after :data:`GIVE_UP_S` and the drain goes on as it would without one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from agent.core.mechanism import NodeCeiling, NodeCounts, SchedulerView
from agent.core.ownership.table import OwnershipTable
from agent.deviceplugin.resources import HealthLookup, Resource, advertised

#: how long the Node must have shown the lower counts before the plugin stops listing a closing
#: GPU: the scheduler's informer sees the patch in milliseconds, and a kubelet admits a pod it
#: was bound within well under a second of the binding
GRACE_S = 1.0
#: a closing GPU whose Node counts could not be lowered this long goes on draining regardless
GIVE_UP_S = 3.0


def node_ceilings(
    resources: Iterable[Resource], ownership: OwnershipTable, health: HealthLookup
) -> dict[str, NodeCeiling]:
    """Per resource: the devices listed, and listed healthy, leaving out the closing GPUs.

    Exactly what the kubelet will report once those GPUs are gone from ListAndWatch (capacity is
    every listed device, allocatable the healthy ones).
    """
    out: dict[str, NodeCeiling] = {}
    for resource in resources:
        staying = [d for d in advertised(resource, ownership, health) if not ownership.closing(d.device.gpu_uuid)]
        out[resource.name] = NodeCeiling(capacity=len(staying), allocatable=sum(1 for d in staying if d.healthy))
    return out


@dataclass(frozen=True, slots=True)
class Closed:
    view: SchedulerView
    #: closing GPUs let go only because the Node could not be lowered in time
    given_up: frozenset[str] = frozenset()


def closed_gpus(resources: Iterable[Resource], ownership: OwnershipTable, counts: NodeCounts, now: float) -> Closed:
    """Which closing GPUs the scheduler no longer counts on (see the module docstring)."""
    closing = {gpu: drain for gpu, drain in ownership.draining.items() if drain.closing}
    if not closing:
        return Closed(SchedulerView(closed=frozenset()))
    names: dict[str, set[str]] = {gpu: set() for gpu in closing}
    for resource in resources:
        for device in resource.devices:
            if device.gpu_uuid in names:
                names[device.gpu_uuid].add(resource.name)
    closed: set[str] = set()
    given_up: set[str] = set()
    notes: list[str] = []
    for gpu, drain in closing.items():
        waiting = _waiting(sorted(names[gpu]), counts, now)
        if not waiting:
            closed.add(gpu)
        elif now - drain.since >= GIVE_UP_S:
            closed.add(gpu)
            given_up.add(gpu)
        else:
            notes.append(waiting)
    return Closed(SchedulerView(closed=frozenset(closed), note="; ".join(dict.fromkeys(notes))), frozenset(given_up))


def _waiting(names: list[str], counts: NodeCounts, now: float) -> str:
    for name in names:
        since = counts.held_since(name)
        if since is None:
            return f"lowering the Node's {name}"
        if now - since < GRACE_S:
            return f"the Node's {name} is lowered; pods bound before may still arrive"
    return ""
