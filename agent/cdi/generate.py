"""Pure functions from an inventory and a look at the driver to CDI specs.

Device plugin spec (one file): a device per GPU by UUID and by index, per MIG device by
UUID and by ``<gpu index>:<mig index>``, and ``all``; the driver's common edits at spec
level. Per-claim spec (one file per prepared DRA claim): a device per claimed device named
``<claim uid>-<device>``, self-contained (common edits included). A device whose nodes are
missing on the host is left out and listed in ``skipped``: no name points at gone hardware.

What goes into each device comes from a :class:`DriverView` (the installed driver's files,
or the simulated driver's environment variables); names, kinds and files are the same for
both, so callers never know which one they got.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from agent.cdi.errors import UnknownCdiDeviceError
from agent.cdi.names import claim_device_name, device_part, split_kind
from agent.cdi.spec import ContainerEdits, Device, DeviceNode, Hook, Spec, check
from agent.core.inventory.model import Gpu, Inventory, MigDevice

ALL_DEVICES = "all"
#: the separator of a share key (``agent.cdi.claimenv.share_key``; that module builds on this one)
SHARE_SEPARATOR = "-share-"


class DriverView(Protocol):
    """One look at the driver: the container edits of the node's devices.

    Implemented by :class:`agent.cdi.discovery.DriverFiles` (an installed driver) and
    :class:`agent.cdi.driversource.SimulatedDriver`. ``None`` from a device method means
    the device cannot be handed out now (its nodes are missing) and is skipped.
    """

    @property
    def version(self) -> str: ...

    def common_edits(self) -> ContainerEdits: ...

    def gpu_edits(self, gpu: Gpu) -> ContainerEdits | None: ...

    def mig_edits(self, gpu: Gpu, mig: MigDevice) -> ContainerEdits | None: ...


@dataclass(frozen=True, slots=True)
class GeneratedSpec:
    spec: Spec | None  # None: nothing to write (no GPUs, or none whose nodes exist)
    names: Mapping[str, str] = field(default_factory=dict)  # device UUID / index / "g:m" -> device name
    skipped: tuple[str, ...] = ()  # device UUIDs left out, with the reason


def gpu_minors(inventory: Inventory) -> list[int]:
    return [gpu.minor for gpu in inventory]


def cap_minors(inventory: Inventory) -> list[int]:
    out: list[int] = []
    for gpu in inventory:
        for mig in gpu.mig_devices:
            out += [m for m in (mig.gi_cap_minor, mig.ci_cap_minor) if m is not None]
    return out


def union(edits: Iterable[ContainerEdits]) -> ContainerEdits:
    """The edits of several devices at once (the ``all`` device): env, nodes and hooks; first one wins."""
    env: dict[str, None] = {}
    nodes: dict[str, DeviceNode] = {}
    hooks: dict[Hook, None] = {}
    for edit in edits:
        env.update(dict.fromkeys(edit.env))
        for node in edit.device_nodes:
            nodes.setdefault(node.path, node)
        hooks.update(dict.fromkeys(edit.hooks))
    return ContainerEdits(env=tuple(env), device_nodes=tuple(nodes.values()), hooks=tuple(hooks))


def _skip_reason(what: str, uuid: str) -> str:
    return f"{uuid}: {what} device nodes missing on the host"


def device_plugin_spec(kind: str, inventory: Inventory, driver: DriverView) -> GeneratedSpec:
    split_kind(kind)
    devices: list[Device] = []
    names: dict[str, str] = {}
    skipped: list[str] = []
    every: list[ContainerEdits] = []

    def add(keys: Sequence[str], edits: ContainerEdits) -> None:
        for key in keys:
            name = device_part(key)
            devices.append(Device(name=name, container_edits=edits))
            names[key] = name
        every.append(edits)

    for gpu in sorted(inventory, key=lambda g: g.index):
        edits = driver.gpu_edits(gpu)
        if edits is None:
            skipped.append(_skip_reason("GPU", gpu.uuid))
            # its MIG devices go with it: a name for them would resolve to nothing
            skipped.extend(_skip_reason("MIG (parent GPU)", mig.uuid) for mig in gpu.mig_devices)
            continue
        add((gpu.uuid, str(gpu.index)), edits)
        for mig in sorted(gpu.mig_devices, key=lambda m: m.index):
            medits = driver.mig_edits(gpu, mig)
            if medits is None:
                skipped.append(_skip_reason("MIG", mig.uuid))
                continue
            add((mig.uuid, f"{gpu.index}:{mig.index}"), medits)
    if not devices:
        return GeneratedSpec(spec=None, names={}, skipped=tuple(skipped))
    devices.append(Device(name=ALL_DEVICES, container_edits=union(every)))
    names[ALL_DEVICES] = ALL_DEVICES
    spec = Spec.at_minimum_version(kind=kind, devices=tuple(devices), container_edits=driver.common_edits())
    return GeneratedSpec(spec=check(spec), names=names, skipped=tuple(skipped))


def claim_spec(
    kind: str,
    claim_uid: str,
    device_ids: Sequence[str],
    inventory: Inventory,
    driver: DriverView,
    *,
    skip_unknown: bool = False,
) -> GeneratedSpec:
    """The transient spec of one claim; ``device_ids`` are GPU or MIG UUIDs (or GPU indexes), or
    share keys (``agent.cdi.claimenv.share_key``: one device per share of a GPU).

    An ID the inventory does not know is an UnknownCdiDeviceError (``skip_unknown``: skipped, as
    the reconciler wants for a prepared claim whose MIG device vanished); a known device whose
    nodes are missing is skipped (the claim's other devices still get their names).
    """
    split_kind(kind)
    devices: list[Device] = []
    names: dict[str, str] = {}
    skipped: list[str] = []
    for device_id in dict.fromkeys(device_ids):
        try:
            edits = _claimed_edits(device_id.partition(SHARE_SEPARATOR)[0], inventory, driver)
        except UnknownCdiDeviceError as exc:
            if not skip_unknown:
                raise
            skipped.append(f"{device_id}: claim {claim_uid}: {exc}")
            continue
        if edits is None:
            skipped.append(_skip_reason("claimed", device_id))
            continue
        name = claim_device_name(claim_uid, device_id)
        devices.append(Device(name=name, container_edits=edits))
        names[device_id] = name
    if not devices:
        return GeneratedSpec(spec=None, names={}, skipped=tuple(skipped))
    spec = Spec.at_minimum_version(kind=kind, devices=tuple(devices), container_edits=driver.common_edits())
    return GeneratedSpec(spec=check(spec), names=names, skipped=tuple(skipped))


def _claimed_edits(device_id: str, inventory: Inventory, driver: DriverView) -> ContainerEdits | None:
    gpu = inventory.find(device_id)
    if gpu is not None:
        return driver.gpu_edits(gpu)
    mig = inventory.find_mig(device_id)
    if mig is not None:
        parent = inventory.find(mig.parent_uuid)
        if parent is None:
            raise UnknownCdiDeviceError(f"MIG device {device_id} has no parent GPU {mig.parent_uuid} in the inventory")
        return driver.mig_edits(parent, mig)
    raise UnknownCdiDeviceError(f"device {device_id!r} is not on this node")
