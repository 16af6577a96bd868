"""Which GPUs the kubelet last heard the device plugin list, from the kubelet's own checkpoint.

The kubelet's device manager writes ``<device-plugins dir>/kubelet_internal_checkpoint`` on every
ListAndWatch message it receives, with the healthy device IDs of each resource
(``RegisteredDevices``; kubernetes/kubernetes ``pkg/kubelet/cm/devicemanager/manager.go``,
``genericDeviceUpdateCallback`` → ``writeCheckpoint``), and keeps the file across its restarts.
A starting agent grants a GPU to the device plugin before asking anyone only when its own
record of grants says so *and* the kubelet's checkpoint shows the plugin listed it last
(:mod:`agent.core.ownership.record`): two independent witnesses, so a record left behind by an
earlier agent version (one that knew no record, moved the GPU elsewhere, and left the file as it
was) is not enough on its own. Anything unreadable counts as "listed nothing".
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from agent.core.inventory.model import Inventory
from agent.deviceplugin.resources import Resource
from agent.deviceplugin.usage import gpu_of_id

CHECKPOINT = "kubelet_internal_checkpoint"
#: the kubelet's checkpoint holds every allocation on the node; a few MiB at most
MAX_BYTES = 8 * 1024 * 1024


def listed_gpus(
    path: Path, *, plan: Mapping[str, Resource], inventory: Inventory, own_names: Iterable[str]
) -> frozenset[str]:
    """Physical GPUs of ours that the kubelet's checkpoint lists as healthy devices of our resources.

    Blocks (file I/O): callers run it off the event loop.
    """
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
        doc = json.loads(raw) if len(raw) <= MAX_BYTES else None
    except (OSError, ValueError):
        return frozenset()
    data = doc.get("Data") if isinstance(doc, dict) else None
    registered = data.get("RegisteredDevices") if isinstance(data, dict) else None
    if not isinstance(registered, dict):
        return frozenset()
    names = set(own_names)
    gpus: set[str] = set()
    for resource, ids in registered.items():
        if resource not in names or not isinstance(ids, list):
            continue
        for device_id in ids:
            if isinstance(device_id, str):
                gpu = gpu_of_id(device_id, resource, plan=plan, inventory=inventory, own_names=names)
                if gpu is not None:
                    gpus.add(gpu)
    return frozenset(gpus)
