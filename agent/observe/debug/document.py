"""The JSON document behind ``GET /debug/state``: one snapshot of the running agent.

Field names that tools and tests rely on (docs/observability.md, "Debug endpoint"):
``devices[].uuid/index/owner/health/mig`` and ``config.version/source/last_error``; more fields may
be added, none removed.
``gpu-agent status`` reads ``devices[].desired_owner/holders/health_detail`` and
``devices[].utilization`` (``gpu_percent``, ``memory_used_mib``, ``memory_total_mib``: numbers, or
null while unknown, with ``known``, ``age_s`` and ``reason``), ``orphans``, ``watchdog``,
``readiness`` (what ``/readyz`` answers, with the failing checks named), ``config.last_error``
and ``mechanisms.*.usage`` (a mechanism that cannot tell who holds its GPUs).

The document is built from an :class:`AgentView`, the read-only face of the running agent;
mechanisms appear only through :class:`~agent.core.mechanism.Mechanism`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from agent import __version__
from agent.core.config.current import ConfigState
from agent.core.config.loader import to_plain
from agent.core.config.schema import Config
from agent.core.health.monitor import HealthMonitor
from agent.core.inventory.current import InventoryState
from agent.core.inventory.model import Gpu
from agent.core.inventory.render import topology_map
from agent.core.mechanism import Holder, Mechanism, Readiness, Usage
from agent.core.ownership.table import OwnershipState
from agent.observe.observers import Observers


class ShowsState(Protocol):
    """A component with its own section of the document (the CDI service)."""

    def debug_state(self) -> dict[str, object]: ...


class AgentView(Protocol):
    """What the state document reads; :class:`agent.runtime.agent.Agent` provides it."""

    node_name: str
    inventories: InventoryState
    health: HealthMonitor
    ownership: OwnershipState
    config_state: ConfigState
    observers: Observers

    @property
    def cdi(self) -> ShowsState: ...

    @property
    def status(self) -> str: ...

    @property
    def mechanisms(self) -> Mapping[str, Mechanism]: ...

    def node_labels(self, config: Config) -> dict[str, str]: ...

    def labels_state(self) -> dict[str, object]: ...

    def backend_state(self) -> dict[str, object]: ...

    def readiness(self) -> Mapping[str, Readiness]: ...


def agent_state(agent: AgentView) -> dict[str, Any]:
    inventory = agent.inventories.current
    usage = {name: mechanism.usage() for name, mechanism in agent.mechanisms.items()}
    devices = [_device(agent, gpu, usage) for gpu in inventory.gpus]
    table = agent.ownership.current
    cs = agent.config_state
    state: dict[str, Any] = {
        "version": __version__,
        "node": {"name": agent.node_name, "labels": agent.node_labels(cs.config), "label_source": agent.labels_state()},
        "status": agent.status,
        "readiness": readiness_report(agent.readiness()),
        "backend": inventory.backend,
        "backend_state": agent.backend_state(),
        "driver_version": inventory.driver_version,
        "cuda_driver_version": inventory.cuda_driver_version,
        "inventory_problems": list(inventory.problems),
        "inventory_reason": inventory.reason,
        "devices": devices,
        "topology": topology_map(inventory),
        "ownership": {
            "node_rule": table.node_rule,
            "counts": {owner.value: n for owner, n in table.counts().items()},
            "draining": table.drain_count(),
            "inert_overrides": list(agent.ownership.desired.inert_overrides),
        },
        "config": {
            "version": cs.loaded.version,
            "source": cs.loaded.source,
            "last_error": cs.last_error,
            "reloads": cs.reloads,
            "rejections": cs.rejections,
            "effective": to_plain(cs.config),
        },
        "mechanisms": {
            name: {
                "usage": {"known": u.known, "reason": u.reason},
                **mechanism.debug_state(),
            }
            for (name, mechanism), u in zip(agent.mechanisms.items(), usage.values(), strict=True)
        },
        "cdi": agent.cdi.debug_state(),
        **agent.observers.debug_state(),
    }
    # the device plugin's section under its historical key, for tools written against it
    if "device-plugin" in state["mechanisms"]:
        state["device_plugin"] = state["mechanisms"]["device-plugin"]
    return state


def readiness_report(checks: Mapping[str, Readiness]) -> dict[str, Any]:
    """What ``/readyz`` answers (``ready``, ``checks``), and which checks fail (``failing``)."""
    return {
        "ready": all(check.ok for check in checks.values()),
        "checks": {name: c.detail or ("ok" if c.ok else "not ready") for name, c in checks.items()},
        "failing": [name for name, check in checks.items() if not check.ok],
    }


def _drain(agent: AgentView, uuid: str) -> dict[str, Any] | None:
    drain = agent.ownership.current.draining.get(uuid)
    if drain is None:
        return None
    return {"from": drain.source.value, "to": drain.target.value, "waiting_for": drain.waiting_for}


def _holder(agent: AgentView, holder: Holder) -> dict[str, object]:
    """A holder as JSON; a pod's UID (PodResources has none) and a claim's pods, once the orphan check read them."""
    out = holder.as_dict()
    orphans = agent.observers.orphans
    if holder.kind == "container" and not holder.uid:
        out["uid"] = orphans.pod_uid(holder.namespace, holder.name)
    elif holder.kind == "claim":
        out["pods"] = [{"name": p, "uid": u} for p, u in orphans.claim_pods(holder.namespace, holder.name, holder.uid)]
    return out


def _device(agent: AgentView, gpu: Gpu, usage: Mapping[str, Usage]) -> dict[str, Any]:
    record = agent.health.record(gpu.uuid)
    return {
        "uuid": gpu.uuid,
        "index": gpu.index,
        "minor": gpu.minor,
        "product_name": gpu.product_name,
        "brand": gpu.brand,
        "architecture": gpu.architecture,
        "compute_capability": gpu.compute_capability,
        "memory_mib": gpu.memory_mib,
        "pci_bus_id": gpu.pci_bus_id,
        "pcie_root": gpu.pcie_root,
        "numa_node": gpu.numa_node,
        "owner": agent.ownership.current.state_of(gpu.uuid),
        "desired_owner": agent.ownership.desired.owner_of(gpu.uuid).value,
        "owner_rule": agent.ownership.desired.rules.get(gpu.uuid, ""),
        "draining": _drain(agent, gpu.uuid),
        "health": agent.health.state(gpu.uuid).value,
        "health_detail": record.as_dict() if record else None,
        "holders": {
            name: [_holder(agent, h) for h in u.holders.get(gpu.uuid, ())] for name, u in usage.items() if u.known
        },
        "xids": {str(x): n for x, n in sorted(agent.health.xid_counts(gpu.uuid).items())},
        "utilization": agent.observers.utilization.get(gpu.uuid).as_dict(),
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
                "utilization": agent.observers.utilization.get(mig.uuid).as_dict(),
            }
            for mig in gpu.mig_devices
        ],
    }
