"""What the device plugin advertises against what the kubelet and the Node show, for the watchdog.

Two views of each resource are compared with the devices its server lists as healthy while the
kubelet holds its ListAndWatch stream (none while it does not: the kubelet marks a plugin's
devices unhealthy the moment the stream ends):

* the kubelet's own, ``GetAllocatableResources`` (healthy devices per resource, from the
  PodResources watcher's newest answer): the same device IDs;
* the Node's ``status.allocatable`` from the API server: the same count.

And, for time-sliced GPUs, how many replicas are advertised and how many containers hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from agent.core.mechanism import NodeStatus, RegistrationCheck
from agent.deviceplugin.podresources import Snapshot
from agent.deviceplugin.resources import Resource
from agent.deviceplugin.server import PluginServer

#: device IDs quoted in a check's detail
SHOWN_IDS = 3


def plugin_checks(
    servers: Mapping[str, PluginServer], kubelet: Snapshot | None, node: NodeStatus
) -> list[RegistrationCheck]:
    """One or two checks per resource; ``kubelet`` None when PodResources cannot answer now."""
    allocatable = kubelet.allocatable if kubelet is not None else None
    checks: list[RegistrationCheck] = []
    for name, server in sorted(servers.items()):
        ours = server.kubelet_view()
        registered = "" if server.registered else " (not registered: the kubelet holds no stream of ours)"
        if allocatable is not None:
            theirs = frozenset(allocatable.get(name, ()))
            extra, missing = sorted(theirs - ours), sorted(ours - theirs)
            detail = f"the kubelet counts {len(theirs)} allocatable {name}, we list {len(ours)} healthy{registered}"
            if extra:
                detail += f"; it counts {_ids(extra)} that we do not list"
            if missing:
                detail += f"; it does not count {_ids(missing)}"
            checks.append(
                RegistrationCheck(
                    key=f"{name} kubelet-allocatable",
                    advertised=len(ours),
                    seen=len(theirs),
                    agrees=theirs == ours,
                    detail=detail,
                    repair=server.request_repair,
                )
            )
        if node.allocatable is not None:
            count = node.allocatable.get(name, 0)
            checks.append(
                RegistrationCheck(
                    key=f"{name} node-allocatable",
                    advertised=len(ours),
                    seen=count,
                    agrees=count == len(ours),
                    detail=f"the Node's status.allocatable says {count} {name}, "
                    f"we list {len(ours)} healthy{registered}",
                    repair=server.request_repair,
                )
            )
    return checks


def _ids(ids: list[str]) -> str:
    shown = ", ".join(i[:48] for i in ids[:SHOWN_IDS])
    return shown + (f" and {len(ids) - SHOWN_IDS} more" if len(ids) > SHOWN_IDS else "")


@dataclass(frozen=True, slots=True)
class ReplicaCount:
    """Time-sliced replicas of one GPU under one resource."""

    resource: str
    gpu_uuid: str
    #: replicas the server lists now (healthy or not; none while the GPU is not ours)
    advertised: int
    #: replicas containers hold, from the newest PodResources answer (None: unknown)
    allocated: int | None

    def as_dict(self) -> dict[str, object]:
        return {
            "resource": self.resource,
            "gpu": self.gpu_uuid,
            "advertised": self.advertised,
            "allocated": self.allocated,
        }


def replica_counts(
    resources: Mapping[str, Resource], servers: Mapping[str, PluginServer], held: Snapshot | None
) -> list[ReplicaCount]:
    """Per time-sliced resource and GPU: replicas advertised and allocated."""
    out: list[ReplicaCount] = []
    for name, resource in sorted(resources.items()):
        if resource.replicas <= 1:
            continue
        server = servers.get(name)
        listed: dict[str, int] = {}
        for state in server.advertised() if server is not None else ():
            listed[state.device.gpu_uuid] = listed.get(state.device.gpu_uuid, 0) + 1
        allocated: dict[str, int] = {}
        if held is not None:
            for container in held.containers:
                if container.resource_name != name:
                    continue
                for device_id in container.device_ids:
                    gpu = resource.gpu_of.get(device_id)
                    if gpu is not None:
                        allocated[gpu] = allocated.get(gpu, 0) + 1
        for gpu in dict.fromkeys(d.gpu_uuid for d in resource.devices):
            out.append(
                ReplicaCount(
                    resource=name,
                    gpu_uuid=gpu,
                    advertised=listed.get(gpu, 0),
                    allocated=allocated.get(gpu, 0) if held is not None else None,
                )
            )
    return out
