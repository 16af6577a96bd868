"""The JSON document behind ``GET /debug/state``: one snapshot of the running agent.

Field names that tools and tests rely on (DESIGN.md): ``devices[].uuid/index/owner/health/mig``
and ``config.version/source/last_error``; more fields may be added, none removed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent import __version__
from agent.config.loader import to_plain
from agent.inventory.render import topology_map

if TYPE_CHECKING:
    from agent.app import Agent


def agent_state(agent: Agent) -> dict[str, Any]:
    table = agent.ownership.current
    devices = []
    for gpu in agent.inventory.gpus:
        record = agent.health.record(gpu.uuid)
        devices.append(
            {
                "uuid": gpu.uuid,
                "index": gpu.index,
                "minor": gpu.minor,
                "product_name": gpu.product_name,
                "architecture": gpu.architecture,
                "compute_capability": gpu.compute_capability,
                "memory_mib": gpu.memory_mib,
                "pci_bus_id": gpu.pci_bus_id,
                "numa_node": gpu.numa_node,
                "owner": table.owner_of(gpu.uuid).value,
                "health": agent.health.state(gpu.uuid).value,
                "health_detail": record.as_dict() if record else None,
                "mig_enabled": gpu.mig_enabled,
                "mig": [
                    {
                        "uuid": mig.uuid,
                        "index": mig.index,
                        "profile": mig.profile,
                        "gpu_instance_id": mig.gpu_instance_id,
                        "compute_instance_id": mig.compute_instance_id,
                        "memory_mib": mig.memory_mib,
                        "health": agent.health.state(mig.uuid).value,
                    }
                    for mig in gpu.mig_devices
                ],
            }
        )
    topology = topology_map(agent.inventory)
    cs = agent.config_state
    return {
        "version": __version__,
        "node": {"name": agent.node_name, "labels": agent.node_labels(cs.config)},
        "status": agent.status,
        "backend": agent.inventory.backend,
        "driver_version": agent.inventory.driver_version,
        "cuda_driver_version": agent.inventory.cuda_driver_version,
        "devices": devices,
        "topology": topology,
        "ownership": {
            "node_rule": table.node_rule,
            "counts": {owner.value: n for owner, n in table.counts().items()},
        },
        "config": {
            "version": cs.loaded.version,
            "source": cs.loaded.source,
            "last_error": cs.last_error,
            "reloads": cs.reloads,
            "rejections": cs.rejections,
            "effective": to_plain(cs.config),
        },
        "device_plugin": agent.plugin.debug_state() if agent.plugin is not None else {"enabled": False},
        "cdi": agent.cdi.debug_state(),
    }
