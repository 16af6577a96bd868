"""Build an :class:`Inventory` from NVML, synchronously.

:class:`InventoryReader` makes many small NVML calls; the backend runs the whole read in
one worker thread (``asyncio.to_thread``) rather than hopping threads per call. Required
fields raise the typed errors of :mod:`agent.inventory.nvml_errors`; optional fields
(NUMA node, architecture, MIG mode, NVLink) fall back when the device or driver does not
support the query.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import structlog

from agent.inventory.model import Gpu, Inventory, Link, MigDevice, PcieLevel, link_key
from agent.inventory.nvml_errors import (
    ERROR_INVALID_ARGUMENT,
    ERROR_NOT_FOUND,
    NOT_SUPPORTED_CODES,
    nvml_code,
    translate,
)

log = structlog.get_logger("agent.nvml")

#: ``nvmlDeviceArchitecture_t`` (C ABI values)
ARCHITECTURES = {
    2: "kepler",
    3: "maxwell",
    4: "pascal",
    5: "volta",
    6: "turing",
    7: "ampere",
    8: "ada",
    9: "hopper",
    10: "blackwell",
    13: "rubin",
}

_MIG_ENABLE = 1
_NVLINK_DEVICE_TYPE_SWITCH = 2
_FEATURE_ENABLED = 1
_DEFAULT_MAX_LINKS = 18
_MIG_PROFILE_RE = re.compile(r"\bMIG\s+(\S+)\s*$")
# /proc/driver/nvidia-caps/mig-minors: "gpu0/gi1/access 12", "gpu0/gi1/ci0/access 13"
_MIG_MINOR_RE = re.compile(r"^gpu(\d+)/gi(\d+)(?:/ci(\d+))?/access\s+(\d+)$")

MigMinors = dict[tuple[int, int, int | None], int]


def text(value: object) -> str:
    """NVML strings arrive as ``str`` (pynvml decodes) or ``bytes`` (ctypes struct fields)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").rstrip("\x00")
    return str(value)


def sysfs_bus_id(bus_id: str) -> str:
    """NVML's ``00000000:18:00.0`` as sysfs spells it: ``0000:18:00.0``."""
    domain, sep, rest = bus_id.strip().partition(":")
    if not sep:
        return bus_id.strip().lower()
    try:
        return f"{int(domain, 16):04x}:{rest}".lower()
    except ValueError:
        return bus_id.strip().lower()


def cuda_version(value: int) -> str:
    """``12040`` -> ``"12.4"``."""
    return f"{value // 1000}.{(value % 1000) // 10}"


def read_numa_node(sysfs_root: Path, bus_id: str) -> int | None:
    path = sysfs_root / "bus" / "pci" / "devices" / sysfs_bus_id(bus_id) / "numa_node"
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def read_mig_minors(procfs_root: Path) -> MigMinors | None:
    """Capability minors keyed by (GPU minor, GI id, CI id or None); None when the file is absent."""
    path = procfs_root / "driver" / "nvidia-caps" / "mig-minors"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    minors: MigMinors = {}
    for line in lines:
        match = _MIG_MINOR_RE.match(line.strip())
        if match is None:
            continue  # "config 1", "monitor 2", blank lines
        gpu, gi, ci, minor = match.groups()
        minors[(int(gpu), int(gi), int(ci) if ci is not None else None)] = int(minor)
    return minors


def profile_from_name(name: str) -> str | None:
    """``"1g.5gb"`` from ``"NVIDIA A100-SXM4-40GB MIG 1g.5gb"``."""
    match = _MIG_PROFILE_RE.search(name)
    return match.group(1) if match is not None else None


def derived_profile(memory_mib: int, slices: int | None) -> str:
    """A profile name when the device name has none: ``"<slices>g.<GiB rounded up>gb"``."""
    gigabytes = math.ceil(memory_mib / 1024)
    return f"{slices}g.{gigabytes}gb" if slices else f"{gigabytes}gb"


def _mib(memory: Any) -> int:
    return int(memory.total) // (1024 * 1024)


@dataclass(slots=True)
class _NvLinks:
    peers: Counter[str]  # links per remote GPU bus id (sysfs form)
    switch_links: int  # links that end at an NVSwitch


class InventoryReader:
    """One synchronous read of the node. Call :meth:`read` from a worker thread."""

    def __init__(self, nvml: ModuleType, *, backend: str, sysfs_root: Path, procfs_root: Path) -> None:
        self._nvml = nvml
        self._backend = backend
        self._sysfs_root = sysfs_root
        self._procfs_root = procfs_root

    # --- call helpers ----------------------------------------------------------------

    def _q(self, doing: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A required value: any NVML error becomes the matching typed error."""
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            raise translate(self._nvml, exc, doing) from exc

    def _opt(self, doing: str, name: str, *args: Any, skip: frozenset[int] = NOT_SUPPORTED_CODES) -> Any:
        """An optional value: None when the binding lacks ``name`` or NVML answers a code in ``skip``."""
        fn = getattr(self._nvml, name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            if nvml_code(self._nvml, exc) in skip:
                return None
            raise translate(self._nvml, exc, doing) from exc

    # --- the read ---------------------------------------------------------------------

    def read(self) -> Inventory:
        nvml = self._nvml
        driver = text(self._q("reading the driver version", nvml.nvmlSystemGetDriverVersion))
        cuda = self._opt("reading the CUDA driver version", "nvmlSystemGetCudaDriverVersion_v2")
        if cuda is None:
            cuda = self._opt("reading the CUDA driver version", "nvmlSystemGetCudaDriverVersion")
        count = int(self._q("counting GPUs", nvml.nvmlDeviceGetCount))
        mig_minors = read_mig_minors(self._procfs_root)
        handles: list[Any] = []
        gpus: list[Gpu] = []
        for index in range(count):
            handle = self._q(f"GPU {index}: getting its handle", nvml.nvmlDeviceGetHandleByIndex, index)
            handles.append(handle)
            gpus.append(self._gpu(index, handle, mig_minors))
        return Inventory(
            backend=self._backend,
            driver_version=driver,
            cuda_driver_version=cuda_version(int(cuda)) if cuda is not None else "",
            gpus=tuple(gpus),
            links=self._links(gpus, handles),
        )

    def _gpu(self, index: int, handle: Any, mig_minors: MigMinors | None) -> Gpu:
        nvml = self._nvml
        uuid = text(self._q(f"GPU {index}: reading its UUID", nvml.nvmlDeviceGetUUID, handle))
        where = f"GPU {index} ({uuid})"
        minor = int(self._q(f"{where}: reading its minor number", nvml.nvmlDeviceGetMinorNumber, handle))
        name = text(self._q(f"{where}: reading its name", nvml.nvmlDeviceGetName, handle))
        arch = self._opt(f"{where}: reading its architecture", "nvmlDeviceGetArchitecture", handle)
        capability = self._opt(f"{where}: reading its compute capability", "nvmlDeviceGetCudaComputeCapability", handle)
        memory = self._q(f"{where}: reading memory info", nvml.nvmlDeviceGetMemoryInfo, handle)
        pci = self._q(f"{where}: reading PCI info", nvml.nvmlDeviceGetPciInfo, handle)
        bus_id = text(pci.busId)
        mig_mode = self._opt(f"{where}: reading MIG mode", "nvmlDeviceGetMigMode", handle)
        mig_enabled = mig_mode is not None and int(mig_mode[0]) == _MIG_ENABLE
        migs = self._mig_devices(where, uuid, minor, handle, mig_minors) if mig_enabled else ()
        return Gpu(
            uuid=uuid,
            index=index,
            minor=minor,
            product_name=name,
            architecture=ARCHITECTURES.get(int(arch), "unknown") if arch is not None else "unknown",
            compute_capability=f"{int(capability[0])}.{int(capability[1])}" if capability is not None else "",
            memory_mib=_mib(memory),
            pci_bus_id=bus_id,
            numa_node=self._numa_node(where, handle, bus_id),
            mig_enabled=mig_enabled,
            mig_devices=migs,
        )

    def _numa_node(self, where: str, handle: Any, bus_id: str) -> int | None:
        node = self._opt(f"{where}: reading its NUMA node", "nvmlDeviceGetNumaNodeId", handle)
        if node is not None and int(node) >= 0:
            return int(node)
        return read_numa_node(self._sysfs_root, bus_id)

    def _mig_devices(
        self, where: str, parent_uuid: str, parent_minor: int, handle: Any, mig_minors: MigMinors | None
    ) -> tuple[MigDevice, ...]:
        nvml = self._nvml
        slots = int(self._q(f"{where}: reading its MIG device count", nvml.nvmlDeviceGetMaxMigDeviceCount, handle))
        out: list[MigDevice] = []
        for slot in range(slots):
            mig = self._opt(
                f"{where}: getting MIG device {slot}",
                "nvmlDeviceGetMigDeviceHandleByIndex",
                handle,
                slot,
                skip=frozenset({ERROR_NOT_FOUND}),
            )
            if mig is None:
                continue  # empty slot
            mwhere = f"{where} MIG device {slot}"
            uuid = text(self._q(f"{mwhere}: reading its UUID", nvml.nvmlDeviceGetUUID, mig))
            gi = int(self._q(f"{mwhere}: reading its GPU instance id", nvml.nvmlDeviceGetGpuInstanceId, mig))
            ci = int(self._q(f"{mwhere}: reading its compute instance id", nvml.nvmlDeviceGetComputeInstanceId, mig))
            memory_mib = _mib(self._q(f"{mwhere}: reading memory info", nvml.nvmlDeviceGetMemoryInfo, mig))
            name = text(self._opt(f"{mwhere}: reading its name", "nvmlDeviceGetName", mig) or "")
            profile = profile_from_name(name) or derived_profile(memory_mib, self._slices(mwhere, mig))
            out.append(
                MigDevice(
                    uuid=uuid,
                    parent_uuid=parent_uuid,
                    index=slot,
                    gpu_instance_id=gi,
                    compute_instance_id=ci,
                    profile=profile,
                    memory_mib=memory_mib,
                    gi_cap_minor=mig_minors.get((parent_minor, gi, None)) if mig_minors is not None else None,
                    ci_cap_minor=mig_minors.get((parent_minor, gi, ci)) if mig_minors is not None else None,
                )
            )
        return tuple(out)

    def _slices(self, where: str, mig: Any) -> int | None:
        attrs = self._opt(f"{where}: reading its attributes", "nvmlDeviceGetAttributes", mig)
        slices = getattr(attrs, "gpuInstanceSliceCount", None)
        return int(slices) if slices else None

    # --- topology ---------------------------------------------------------------------

    def _links(self, gpus: list[Gpu], handles: list[Any]) -> dict[tuple[str, str], Link]:
        nvlinks = [self._nvlinks(gpu, handle) for gpu, handle in zip(gpus, handles, strict=True)]
        links: dict[tuple[str, str], Link] = {}
        for i, a in enumerate(gpus):
            for j in range(i + 1, len(gpus)):
                b = gpus[j]
                direct = max(nvlinks[i].peers[sysfs_bus_id(b.pci_bus_id)], nvlinks[j].peers[sysfs_bus_id(a.pci_bus_id)])
                # behind NVSwitches every GPU reaches every other over all its switch links
                switched = min(nvlinks[i].switch_links, nvlinks[j].switch_links)
                links[link_key(a.uuid, b.uuid)] = Link(
                    nvlinks=direct + switched, pcie=self._pcie_level(a, b, handles[i], handles[j])
                )
        return links

    def _pcie_level(self, a: Gpu, b: Gpu, ha: Any, hb: Any) -> PcieLevel:
        where = f"GPUs {a.index} ({a.uuid}) and {b.index} ({b.uuid}): reading their common PCIe ancestor"
        level = self._opt(where, "nvmlDeviceGetTopologyCommonAncestor", ha, hb)
        if level is None:
            return PcieLevel.SYSTEM
        try:
            return PcieLevel(int(level))
        except ValueError:
            log.debug("unknown NVML topology level; assuming cross-socket", uuid=a.uuid, peer=b.uuid, level=level)
            return PcieLevel.SYSTEM

    def _nvlinks(self, gpu: Gpu, handle: Any) -> _NvLinks:
        where = f"GPU {gpu.index} ({gpu.uuid})"
        # a link index the device does not have answers NOT_SUPPORTED or INVALID_ARGUMENT
        skip = NOT_SUPPORTED_CODES | {ERROR_INVALID_ARGUMENT, ERROR_NOT_FOUND}
        peers: Counter[str] = Counter()
        switch_links = 0
        max_links = int(getattr(self._nvml, "NVML_NVLINK_MAX_LINKS", _DEFAULT_MAX_LINKS))
        for link in range(max_links):
            doing = f"{where}: reading NVLink {link}"
            state = self._opt(doing, "nvmlDeviceGetNvLinkState", handle, link, skip=skip)
            if state is None or int(state) != _FEATURE_ENABLED:
                continue
            pci = self._opt(doing, "nvmlDeviceGetNvLinkRemotePciInfo", handle, link, skip=skip)
            if pci is None:
                continue
            remote = sysfs_bus_id(text(pci.busId))
            kind = self._opt(doing, "nvmlDeviceGetNvLinkRemoteDeviceType", handle, link, skip=skip)
            if kind is not None and int(kind) == _NVLINK_DEVICE_TYPE_SWITCH:
                switch_links += 1
            else:
                peers[remote] += 1
        return _NvLinks(peers=peers, switch_links=switch_links)
