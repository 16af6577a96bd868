"""Which physical GPUs the kubelet's containers hold through the device plugin.

PodResources lists device IDs as the plugin advertised them: GPU or MIG UUIDs, indexes
(``"3"``, ``"3:1"``), each possibly a time-slicing replica (``<id>::<n>``). :func:`device_usage`
maps them back to physical GPUs through the current resource plan first and, for IDs the plan
no longer lists (handed out under an earlier config), through the inventory: UUIDs always
(they name one GPU whoever advertised them), indexes only under resource names this plugin
serves. IDs that map to nothing are reported, never guessed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from agent.core.inventory.model import Inventory
from agent.core.mechanism import Holder, Usage
from agent.deviceplugin.podresources import Snapshot
from agent.deviceplugin.resources import REPLICA_SEPARATOR, Resource

_INDEX = re.compile(r"(\d{1,4})(?::(\d{1,4}))?")
#: unmapped IDs kept for /debug/state
MAX_UNMAPPED = 20


@dataclass(frozen=True, slots=True)
class DeviceUsage:
    usage: Usage
    #: "<resource> <id> (<namespace>/<pod>)" for IDs that name no GPU of this node
    unmapped: tuple[str, ...] = ()


def gpu_of_id(
    device_id: str, resource_name: str, *, plan: Mapping[str, Resource], inventory: Inventory, own_names: Iterable[str]
) -> str | None:
    """The physical GPU behind one advertised device ID, or None."""
    resource = plan.get(resource_name)
    if resource is not None and device_id in resource.by_id:
        return resource.by_id[device_id].gpu_uuid
    base = device_id.split(REPLICA_SEPARATOR, 1)[0]
    for gpu in inventory.gpus:
        if gpu.uuid == base:
            return gpu.uuid
        if any(m.uuid == base for m in gpu.mig_devices):
            return gpu.uuid
    match = _INDEX.fullmatch(base)
    if match is not None and resource_name in set(own_names):
        found = inventory.find(match.group(1))
        return found.uuid if found is not None else None
    return None


def device_usage(
    snapshot: Snapshot | None,
    *,
    reason: str,
    plan: Mapping[str, Resource],
    inventory: Inventory,
    own_names: Iterable[str],
) -> DeviceUsage:
    """The device plugin's :class:`~agent.core.mechanism.Usage` from a PodResources answer.

    ``snapshot`` None (or ``reason`` set: the newest call failed) means unknown.
    """
    if snapshot is None or reason:
        return DeviceUsage(Usage(known=False, reason=reason or "no answer from PodResources yet"))
    if snapshot.truncated:
        return DeviceUsage(Usage(known=False, reason="the PodResources answer was too large to read whole"))
    names = set(own_names)
    holders: dict[str, list[Holder]] = {}
    unmapped: list[str] = []
    for c in snapshot.containers:
        ids_by_gpu: dict[str, list[str]] = {}
        for device_id in c.device_ids:
            gpu = gpu_of_id(device_id, c.resource_name, plan=plan, inventory=inventory, own_names=names)
            if gpu is None:
                if c.resource_name in names and len(unmapped) < MAX_UNMAPPED:
                    unmapped.append(f"{c.resource_name} {device_id[:80]} ({c.namespace}/{c.pod})")
                continue
            ids_by_gpu.setdefault(gpu, []).append(device_id)
        for gpu, ids in ids_by_gpu.items():
            holders.setdefault(gpu, []).append(
                Holder(kind="container", namespace=c.namespace, name=c.pod, detail=c.container, devices=tuple(ids))
            )
    usage = Usage(known=True, holders={g: tuple(h) for g, h in holders.items()}, as_of=snapshot.as_of)
    return DeviceUsage(usage, tuple(unmapped))
