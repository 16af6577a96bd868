"""Allocate and PreStartContainer for one resource: validate the device IDs, build the answer.

Pure domain code: requests come in as lists of device IDs, answers go out as
:class:`ContainerAllocation` dataclasses; the servicer translates both to protobuf.
Every refusal is an :class:`AllocationError` whose kind says which gRPC status it becomes:

================================================  ===================
request                                           kind
================================================  ===================
no container requests / a container with no IDs   INVALID_ARGUMENT
more than MAX_CONTAINER_REQUESTS containers, or   INVALID_ARGUMENT
more IDs in one list than the resource has
the same ID twice in one container                INVALID_ARGUMENT
the same ID in two containers of one request      INVALID_ARGUMENT
an ID this resource never lists                   INVALID_ARGUMENT
several replicas of one device, when the          INVALID_ARGUMENT
time-slicing config refuses them
an ID of a GPU not owned by ``device-plugin``     FAILED_PRECONDITION
an ID of an unhealthy device                      FAILED_PRECONDITION
the CDI spec could not be ensured                 FAILED_PRECONDITION
================================================  ===================

Device-list strategies (NVIDIA's, combinable): ``envvar`` sets ``NVIDIA_VISIBLE_DEVICES`` to the
devices; ``volume-mounts`` sets it to :data:`VOLUME_MOUNT_ROOT` and mounts ``/dev/null`` at
``<root>/<id>`` per device (overriding ``envvar``'s value, as NVIDIA's plugin does);
``cdi-annotations`` adds ``cdi.k8s.io/<plugin>_<request id>`` = comma-separated CDI names;
``cdi-cri`` fills the response's CDI device list. Replica IDs resolve to their physical device,
listed once.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agent.base.errors import AgentError
from agent.core.config.schema import Owner, PluginConfig
from agent.core.ownership.table import OwnershipTable
from agent.deviceplugin.cdinames import CdiNames
from agent.deviceplugin.errors import AllocationError, ErrorKind, format_ids
from agent.deviceplugin.resources import HealthLookup, PluginDevice, Resource

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
VOLUME_MOUNT_ROOT = "/var/run/nvidia-container-devices"
VOLUME_MOUNT_HOST_PATH = "/dev/null"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
#: the plugin part of the CDI annotation key (key name part stays under 63 characters)
CDI_PLUGIN_NAME = "gpu-node-agent"
#: the kubelet sends exactly one container request per call; the protocol allows more
MAX_CONTAINER_REQUESTS = 64


@dataclass(frozen=True, slots=True)
class MountSpec:
    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    """What one container gets; the servicer turns it into a ``ContainerAllocateResponse``."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: tuple[MountSpec, ...] = ()
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()

    def key(self) -> AllocationKey:
        """Hashable and equal exactly when the allocations are (for caching their answers)."""
        return (tuple(self.envs.items()), self.mounts, tuple(self.annotations.items()), self.cdi_devices)

    @classmethod
    def from_key(cls, key: AllocationKey) -> ContainerAllocation:
        envs, mounts, annotations, cdi_devices = key
        return cls(envs=dict(envs), mounts=mounts, annotations=dict(annotations), cdi_devices=cdi_devices)

    def summary(self) -> dict[str, object]:
        """The non-empty parts, for a log line."""
        out: dict[str, object] = {}
        if self.envs:
            out["envs"] = self.envs
        if self.mounts:
            out["mounts"] = [m.container_path for m in self.mounts]
        if self.annotations:
            out["annotations"] = self.annotations
        if self.cdi_devices:
            out["cdi_devices"] = list(self.cdi_devices)
        return out


#: :meth:`ContainerAllocation.key`: envs, mounts, annotations, CDI devices
AllocationKey = tuple[tuple[tuple[str, str], ...], tuple[MountSpec, ...], tuple[tuple[str, str], ...], tuple[str, ...]]


def check_request_size(resource: Resource, containers: Sequence[Sequence[Sequence[str]]], what: str) -> None:
    """Refuse a request too large to be real before any per-ID work (AllocationError).

    ``containers`` holds, per container request, its ID lists (Allocate: the devices;
    GetPreferredAllocation: available and must-include). A list longer than the resource has
    devices must repeat or invent IDs; the kubelet sends one container request per call.
    """
    name = resource.name
    if len(containers) > MAX_CONTAINER_REQUESTS:
        raise AllocationError(
            ErrorKind.INVALID_ARGUMENT,
            f"{what} {name}: {len(containers)} container requests, at most {MAX_CONTAINER_REQUESTS} in one call",
        )
    have = len(resource.by_id)
    for lists in containers:
        for ids in lists:
            if len(ids) > have:
                raise AllocationError(
                    ErrorKind.INVALID_ARGUMENT,
                    f"{what} {name}: {len(ids)} device IDs in one list, but the resource has {have} devices",
                )


def resolve_ids(
    resource: Resource,
    ids: Sequence[str],
    *,
    ownership: OwnershipTable,
    health: HealthLookup,
    what: str = "allocate",
) -> list[PluginDevice]:
    """The devices behind ``ids`` if every one may be handed out now; AllocationError if not."""
    name = resource.name
    if not ids:
        raise AllocationError(ErrorKind.INVALID_ARGUMENT, f"{what} {name}: empty device list")
    check_request_size(resource, [[ids]], what)
    dups = sorted(i for i, n in Counter(ids).items() if n > 1) if len(set(ids)) != len(ids) else []
    if dups:
        raise AllocationError(
            ErrorKind.INVALID_ARGUMENT, f"{what} {name}: duplicate device IDs {format_ids(dups)}", tuple(dups)
        )
    unknown = [i for i in ids if i not in resource.by_id]
    if unknown:
        raise AllocationError(
            ErrorKind.INVALID_ARGUMENT, f"{what} {name}: unknown device IDs {format_ids(unknown)}", tuple(unknown)
        )
    devices = [resource.by_id[i] for i in ids]
    foreign = [d.id for d in devices if not ownership.granted_to(d.gpu_uuid, Owner.DEVICE_PLUGIN)]
    if foreign:
        owners = sorted({ownership.owner_of(resource.by_id[i].gpu_uuid).value for i in foreign})
        raise AllocationError(
            ErrorKind.FAILED_PRECONDITION,
            f"{what} {name}: devices not owned by the device plugin (owner {', '.join(owners)}): {format_ids(foreign)}",
            tuple(foreign),
        )
    sick = [d.id for d in devices if not health.is_healthy(d.target_uuid)]
    if sick:
        raise AllocationError(
            ErrorKind.FAILED_PRECONDITION, f"{what} {name}: unhealthy devices {format_ids(sick)}", tuple(sick)
        )
    if resource.replicas > 1 and resource.fail_requests_greater_than_one:
        per_target = Counter(d.target_uuid for d in devices)
        shared = [d.id for d in devices if per_target[d.target_uuid] > 1]
        if shared:
            raise AllocationError(
                ErrorKind.INVALID_ARGUMENT,
                f"{what} {name}: several replicas of one device requested ({format_ids(shared)}); "
                "time_slicing.fail_requests_greater_than_one refuses them",
                tuple(shared),
            )
    return devices


def unique_targets(devices: Sequence[PluginDevice]) -> list[PluginDevice]:
    """One device per physical target (replicas collapse), in request order."""
    seen: set[str] = set()
    out: list[PluginDevice] = []
    for d in devices:
        if d.target_uuid not in seen:
            seen.add(d.target_uuid)
            out.append(d)
    return out


def _shared_between_containers(requests: Sequence[Sequence[str]]) -> list[str]:
    """IDs that appear in more than one container request, sorted (within one is resolve_ids' job)."""
    if len(requests) == 1:
        return []
    containers = Counter(i for ids in requests for i in set(ids))
    return sorted(i for i, n in containers.items() if n > 1)


class Allocator:
    """Builds container allocations for one resource under one plugin config.

    Called by the servicer for Allocate and PreStartContainer; stateless apart from its
    collaborators, so concurrent calls need no lock.
    """

    def __init__(
        self,
        *,
        config: PluginConfig,
        cdi: CdiNames,
        request_id: Callable[[], str] = lambda: str(uuid.uuid4()),
    ) -> None:
        self._config = config
        self._cdi = cdi
        self._request_id = request_id

    @property
    def uses_cdi(self) -> bool:
        return any(s.startswith("cdi-") for s in self._config.device_list_strategy)

    async def allocate(
        self,
        resource: Resource,
        requests: Sequence[Sequence[str]],
        *,
        ownership: OwnershipTable,
        health: HealthLookup,
    ) -> list[ContainerAllocation]:
        """One allocation per container request, in order; all validated before any is built."""
        if not requests:
            raise AllocationError(ErrorKind.INVALID_ARGUMENT, f"allocate {resource.name}: no container requests")
        check_request_size(resource, [[ids] for ids in requests], "allocate")
        resolved = [resolve_ids(resource, ids, ownership=ownership, health=health) for ids in requests]
        shared = _shared_between_containers(requests)
        if shared:
            # one device cannot go to two containers (replicas have IDs of their own)
            raise AllocationError(
                ErrorKind.INVALID_ARGUMENT,
                f"allocate {resource.name}: device IDs requested by more than one container {format_ids(shared)}",
                tuple(shared),
            )
        try:
            if self.uses_cdi:
                await self._cdi.ensure_device_plugin_spec()
            return [self.build(unique_targets(devices)) for devices in resolved]
        except (AgentError, OSError) as exc:
            raise AllocationError(
                ErrorKind.FAILED_PRECONDITION,
                f"allocate {resource.name}: CDI spec for the device plugin is not available: {exc}",
                tuple(i for ids in requests for i in ids),
            ) from exc

    def prestart(
        self, resource: Resource, ids: Sequence[str], *, ownership: OwnershipTable, health: HealthLookup
    ) -> None:
        resolve_ids(resource, ids, ownership=ownership, health=health, what="pre-start")

    def build(self, targets: Sequence[PluginDevice]) -> ContainerAllocation:
        strategies = self._config.device_list_strategy
        envs: dict[str, str] = {}
        mounts: tuple[MountSpec, ...] = ()
        annotations: dict[str, str] = {}
        cdi_devices: tuple[str, ...] = ()
        visible = [d.visible_id for d in targets]
        if "envvar" in strategies:
            envs[VISIBLE_DEVICES_ENV] = ",".join(visible)
        if "volume-mounts" in strategies:
            envs[VISIBLE_DEVICES_ENV] = VOLUME_MOUNT_ROOT
            mounts = tuple(
                MountSpec(container_path=f"{VOLUME_MOUNT_ROOT}/{v}", host_path=VOLUME_MOUNT_HOST_PATH) for v in visible
            )
        if self.uses_cdi:
            names = [self._cdi.device_name(d.target_uuid) for d in targets]
            if "cdi-annotations" in strategies:
                annotations[f"{CDI_ANNOTATION_PREFIX}{CDI_PLUGIN_NAME}_{self._request_id()}"] = ",".join(names)
            if "cdi-cri" in strategies:
                cdi_devices = tuple(names)
        return ContainerAllocation(envs=envs, mounts=mounts, annotations=annotations, cdi_devices=cdi_devices)
