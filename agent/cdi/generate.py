"""Pure functions from an inventory and a look at the driver to CDI specs.

Device plugin spec (one file): a device per GPU by UUID and by index, per MIG device by
UUID and by ``<gpu index>:<mig index>``, and ``all``; the driver's common edits at spec
level. Per-claim spec (one file per prepared DRA claim): a device per claimed device named
``<claim uid>-<device>``, self-contained (common edits included). A device whose nodes are
missing on the host is left out and listed in ``skipped``: no name points at gone hardware.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from agent.cdi.discovery import DriverFiles
from agent.cdi.errors import UnknownCdiDeviceError
from agent.cdi.names import claim_device_name, device_part, split_kind
from agent.cdi.spec import ContainerEdits, Device, DeviceNode, Spec, check
from agent.inventory.model import Gpu, Inventory, MigDevice

ALL_DEVICES = "all"


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


def gpu_nodes(gpu: Gpu, driver: DriverFiles) -> tuple[DeviceNode, ...] | None:
    node = driver.gpu_nodes.get(gpu.minor)
    return (node,) if node is not None else None


def mig_nodes(gpu: Gpu, mig: MigDevice, driver: DriverFiles) -> tuple[DeviceNode, ...] | None:
    if mig.gi_cap_minor is None or mig.ci_cap_minor is None:
        return None
    nodes = [driver.gpu_nodes.get(gpu.minor), driver.cap_nodes.get(mig.gi_cap_minor)]
    nodes.append(driver.cap_nodes.get(mig.ci_cap_minor))
    if any(n is None for n in nodes):
        return None
    return tuple(n for n in nodes if n is not None)


def _skip_reason(what: str, uuid: str) -> str:
    return f"{uuid}: {what} device nodes missing on the host"


def device_plugin_spec(kind: str, inventory: Inventory, driver: DriverFiles) -> GeneratedSpec:
    split_kind(kind)
    devices: list[Device] = []
    names: dict[str, str] = {}
    skipped: list[str] = []
    every: dict[str, DeviceNode] = {}

    def add(keys: Sequence[str], nodes: tuple[DeviceNode, ...]) -> None:
        edits = ContainerEdits(device_nodes=nodes)
        for key in keys:
            name = device_part(key)
            devices.append(Device(name=name, container_edits=edits))
            names[key] = name
        for node in nodes:
            every.setdefault(node.path, node)

    for gpu in sorted(inventory, key=lambda g: g.index):
        nodes = gpu_nodes(gpu, driver)
        if nodes is None:
            skipped.append(_skip_reason("GPU", gpu.uuid))
            continue
        add((gpu.uuid, str(gpu.index)), nodes)
        for mig in sorted(gpu.mig_devices, key=lambda m: m.index):
            mnodes = mig_nodes(gpu, mig, driver)
            if mnodes is None:
                skipped.append(_skip_reason("MIG", mig.uuid))
                continue
            add((mig.uuid, f"{gpu.index}:{mig.index}"), mnodes)
    if not devices:
        return GeneratedSpec(spec=None, names={}, skipped=tuple(skipped))
    devices.append(Device(name=ALL_DEVICES, container_edits=ContainerEdits(device_nodes=tuple(every.values()))))
    names[ALL_DEVICES] = ALL_DEVICES
    spec = Spec.at_minimum_version(kind=kind, devices=tuple(devices), container_edits=driver.common_edits())
    return GeneratedSpec(spec=check(spec), names=names, skipped=tuple(skipped))


def claim_spec(
    kind: str, claim_uid: str, device_ids: Sequence[str], inventory: Inventory, driver: DriverFiles
) -> GeneratedSpec:
    """The transient spec of one claim; ``device_ids`` are GPU or MIG UUIDs (or GPU indexes).

    An ID the inventory does not know is an UnknownCdiDeviceError; a known device whose
    nodes are missing is skipped (the claim's other devices still get their names).
    """
    split_kind(kind)
    devices: list[Device] = []
    names: dict[str, str] = {}
    skipped: list[str] = []
    for device_id in dict.fromkeys(device_ids):
        nodes = _claimed_nodes(device_id, inventory, driver)
        if nodes is None:
            skipped.append(_skip_reason("claimed", device_id))
            continue
        name = claim_device_name(claim_uid, device_id)
        devices.append(Device(name=name, container_edits=ContainerEdits(device_nodes=nodes)))
        names[device_id] = name
    if not devices:
        return GeneratedSpec(spec=None, names={}, skipped=tuple(skipped))
    spec = Spec.at_minimum_version(kind=kind, devices=tuple(devices), container_edits=driver.common_edits())
    return GeneratedSpec(spec=check(spec), names=names, skipped=tuple(skipped))


def _claimed_nodes(device_id: str, inventory: Inventory, driver: DriverFiles) -> tuple[DeviceNode, ...] | None:
    gpu = inventory.find(device_id)
    if gpu is not None:
        return gpu_nodes(gpu, driver)
    mig = inventory.find_mig(device_id)
    if mig is not None:
        parent = inventory.find(mig.parent_uuid)
        if parent is None:
            raise UnknownCdiDeviceError(f"MIG device {device_id} has no parent GPU {mig.parent_uuid} in the inventory")
        return mig_nodes(parent, mig, driver)
    raise UnknownCdiDeviceError(f"device {device_id!r} is not on this node")
