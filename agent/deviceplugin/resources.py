"""Which extended resources this node advertises, and which devices each one lists.

Two steps, both pure:

* :func:`plan_resources` (inventory + ``plugin`` config) decides the resource names and every
  device each *could* list — MIG strategy, time-slicing replicas, device-ID strategy, renaming.
  It ignores ownership and health, so it only changes when the inventory or the plugin config
  does, and a resource keeps its server while its GPUs are handed to another owner (the kubelet
  then sees capacity drop, instead of a stale resource that lingers for its 5-minute grace).
* :func:`advertised` narrows one resource to the devices of GPUs owned by ``device-plugin``,
  each with its health, at the moment of asking. ListAndWatch sends exactly this list.

Resource names follow NVIDIA's device plugin: whole GPUs as ``<resource_name>``; MIG strategy
``single`` advertises MIG devices (all of one profile) under ``<resource_name>``; ``mixed``
advertises one ``<domain>/mig-<profile>`` per profile next to the whole non-MIG GPUs;
time-slicing with ``rename_by_default`` appends ``.shared``. Replica IDs are
``<base-id>::<n>`` and map back to their physical device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from agent.core.config.schema import Owner, PluginConfig
from agent.core.inventory.model import Gpu, Inventory, MigDevice
from agent.core.ownership.table import OwnershipTable

REPLICA_SEPARATOR = "::"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


class HealthLookup(Protocol):
    """What the plugin needs from the health monitor (``HealthMonitor`` satisfies it)."""

    def is_healthy(self, uuid: str) -> bool: ...


SOCKET_PREFIX = "gpu-node-agent-"


@dataclass(frozen=True, slots=True)
class PluginDevice:
    """One device ID the kubelet may see, and what it stands for on the node."""

    id: str  # the ID in ListAndWatch / Allocate
    base_id: str  # the ID without a replica suffix
    target_uuid: str  # the GPU or MIG UUID a container gets (CDI names, health)
    gpu_uuid: str  # the physical GPU (ownership, topology)
    mig_uuid: str | None
    visible_id: str  # NVIDIA_VISIBLE_DEVICES form: the UUID, or "<index>" / "<index>:<mig index>"
    numa_node: int | None


@dataclass(frozen=True, slots=True)
class Resource:
    """One extended resource: one gRPC server, one socket, one Register."""

    name: str
    devices: tuple[PluginDevice, ...]
    replicas: int = 1
    fail_requests_greater_than_one: bool = False
    by_id: Mapping[str, PluginDevice] = field(init=False, repr=False, compare=False)
    #: device ID -> physical GPU UUID, for every device this resource could list
    gpu_of: Mapping[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_id", {d.id: d for d in self.devices})
        object.__setattr__(self, "gpu_of", {d.id: d.gpu_uuid for d in self.devices})

    @property
    def socket_name(self) -> str:
        """The socket file name: ``nvidia.com/gpu`` -> ``gpu-node-agent-nvidia-gpu.sock``.

        Prefixed with the agent's name so that it never takes the socket of NVIDIA's own device
        plugin (``nvidia-gpu.sock``), which may run beside it during a migration.
        """
        domain, _, short = self.name.partition("/")
        return f"{SOCKET_PREFIX}{domain.split('.')[0]}-{short}.sock"


@dataclass(frozen=True, slots=True)
class ResourcePlan:
    resources: tuple[Resource, ...] = ()
    #: configuration the plan could not honour (shown in /debug/state and logged)
    problems: tuple[str, ...] = ()

    def names(self) -> list[str]:
        return [r.name for r in self.resources]


@dataclass(frozen=True, slots=True)
class DeviceState:
    device: PluginDevice
    healthy: bool

    @property
    def health(self) -> str:
        return HEALTHY if self.healthy else UNHEALTHY


def plan_resources(inventory: Inventory, config: PluginConfig) -> ResourcePlan:
    """Resource names and candidate devices for ``inventory`` under ``config``.

    ``plugin.enabled: false`` plans nothing, so switching the plugin off (or on) in a live
    config update stops (or starts) every server through the ordinary re-plan.
    """
    if not config.enabled:
        return ResourcePlan()
    gpus = sorted(inventory.gpus, key=lambda g: g.index)
    by_name: dict[str, list[PluginDevice]] = {}
    problems: list[str] = []
    domain = config.resource_name.partition("/")[0]

    def add(name: str, device: PluginDevice) -> None:
        by_name.setdefault(name, []).append(device)

    strategy = config.mig_strategy
    if strategy == "single" and any(g.mig_enabled for g in gpus):
        profiles = sorted({m.profile for g in gpus if g.mig_enabled for m in g.mig_devices})
        if len(profiles) > 1:
            problems.append(
                f"mig_strategy single needs one MIG profile on every GPU, found {', '.join(profiles)}; "
                f"nothing advertised as {config.resource_name} (use mig_strategy mixed)"
            )
            gpus = []
        for gpu in gpus:
            if not gpu.mig_enabled:
                problems.append(f"mig_strategy single: GPU {gpu.index} ({gpu.uuid}) has MIG disabled, not advertised")
                continue
            for mig in gpu.mig_devices:
                add(config.resource_name, _mig_device(gpu, mig, config))
    else:
        for gpu in gpus:
            if strategy == "mixed" and gpu.mig_enabled:
                for mig in gpu.mig_devices:
                    add(f"{domain}/mig-{mig.profile}", _mig_device(gpu, mig, config))
            else:
                add(config.resource_name, _gpu_device(gpu, config))

    sharing = config.time_slicing
    resources: list[Resource] = []
    for name, devices in by_name.items():
        if sharing.replicas > 1:
            devices = [_replica(d, n) for d in devices for n in range(sharing.replicas)]
            if sharing.rename_by_default:
                name = f"{name}.shared"
        resources.append(
            Resource(
                name=name,
                devices=tuple(devices),
                replicas=sharing.replicas,
                fail_requests_greater_than_one=sharing.fail_requests_greater_than_one,
            )
        )
    resources.sort(key=lambda r: r.name)
    return ResourcePlan(resources=tuple(resources), problems=tuple(problems))


def advertised(resource: Resource, ownership: OwnershipTable, health: HealthLookup) -> list[DeviceState]:
    """The devices ListAndWatch lists now: those of GPUs owned by ``device-plugin``."""
    return [
        DeviceState(device=d, healthy=health.is_healthy(d.target_uuid))
        for d in resource.devices
        if ownership.granted_to(d.gpu_uuid, Owner.DEVICE_PLUGIN)
    ]


def _gpu_device(gpu: Gpu, config: PluginConfig) -> PluginDevice:
    ident = gpu.uuid if config.device_id_strategy == "uuid" else str(gpu.index)
    return PluginDevice(
        id=ident,
        base_id=ident,
        target_uuid=gpu.uuid,
        gpu_uuid=gpu.uuid,
        mig_uuid=None,
        visible_id=ident,
        numa_node=gpu.numa_node,
    )


def _mig_device(gpu: Gpu, mig: MigDevice, config: PluginConfig) -> PluginDevice:
    ident = mig.uuid if config.device_id_strategy == "uuid" else f"{gpu.index}:{mig.index}"
    return PluginDevice(
        id=ident,
        base_id=ident,
        target_uuid=mig.uuid,
        gpu_uuid=gpu.uuid,
        mig_uuid=mig.uuid,
        visible_id=ident,
        numa_node=gpu.numa_node,
    )


def _replica(device: PluginDevice, n: int) -> PluginDevice:
    return PluginDevice(
        id=f"{device.base_id}{REPLICA_SEPARATOR}{n}",
        base_id=device.base_id,
        target_uuid=device.target_uuid,
        gpu_uuid=device.gpu_uuid,
        mig_uuid=device.mig_uuid,
        visible_id=device.visible_id,
        numa_node=device.numa_node,
    )
