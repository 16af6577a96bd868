"""What the kernel's sysfs says about a GPU's PCI device: NUMA node, PCIe root, DRM nodes.

``sysfs_root`` is ``/sys`` in production and a temporary tree in tests. Every reader answers
None (or nothing) when the file is missing or unreadable: sysfs describes optional facts.

* NUMA node: ``/sys/bus/pci/devices/<bus id>/numa_node``, as NVIDIA's device plugin reads it.
  This is the node of the CPUs and memory the PCI device is attached to. NVML's
  ``nvmlDeviceGetNumaNodeId`` answers something else on Grace systems (GH200, GB200): the
  GPU's own memory node, which has no CPUs, so a Topology Manager set to ``single-numa-node``
  would reject every pod. The agent therefore never asks NVML.
* PCIe root: the first directory under ``/sys/devices`` that ``/sys/bus/pci/devices/<bus id>``
  links to (``pci0000:00``), the value Kubernetes' ``resource.kubernetes.io/pcieRoot``
  attribute carries (k8s.io/dynamic-resource-allocation ``deviceattribute``).
* DRM nodes: the ``card*`` and ``renderD*`` entries of ``/sys/bus/pci/devices/<bus id>/drm``,
  which name ``/dev/dri/<entry>`` (as nvidia-container-toolkit's ``drm`` package does).
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

#: a PCI address as sysfs spells it: domain:bus:device.function, lower-case hex
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
#: at most this many DRM entries per device are looked at (a GPU has one card and one render node)
MAX_DRM_ENTRIES = 16


def sysfs_bus_id(bus_id: str) -> str:
    """NVML's ``00000000:18:00.0`` as sysfs spells it: ``0000:18:00.0``."""
    domain, sep, rest = bus_id.strip().partition(":")
    if not sep:
        return bus_id.strip().lower()
    try:
        return f"{int(domain, 16):04x}:{rest}".lower()
    except ValueError:
        return bus_id.strip().lower()


def _device_link(sysfs_root: Path, bus_id: str) -> Path | None:
    bdf = sysfs_bus_id(bus_id)
    if not _BDF.fullmatch(bdf):
        return None
    return sysfs_root / "bus" / "pci" / "devices" / bdf


def numa_node(sysfs_root: Path, bus_id: str) -> int | None:
    """The CPU-side NUMA node of the PCI device; None when unknown (``-1`` in sysfs)."""
    link = _device_link(sysfs_root, bus_id)
    if link is None:
        return None
    try:
        node = int((link / "numa_node").read_text(encoding="ascii").strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return node if node >= 0 else None


def pcie_root(sysfs_root: Path, bus_id: str) -> str | None:
    """``pci<domain>:<bus>`` of the root complex above the device; None when it cannot be told."""
    link = _device_link(sysfs_root, bus_id)
    if link is None:
        return None
    try:
        target = os.readlink(link)
    except OSError:
        return None
    resolved = PurePosixPath(os.path.normpath(os.path.join(str(link.parent), target)))
    devices = PurePosixPath(sysfs_root) / "devices"
    try:
        relative = resolved.relative_to(devices)
    except ValueError:
        return None
    if not relative.parts or not relative.parts[0].startswith("pci") or resolved.name != link.name:
        return None
    return relative.parts[0]


def drm_nodes(sysfs_root: Path, bus_id: str) -> list[str]:
    """``/dev/dri/card1``, ``/dev/dri/renderD128``... of the device, cards first; empty when none."""
    link = _device_link(sysfs_root, bus_id)
    if link is None:
        return []
    try:
        names = sorted(os.listdir(link / "drm"))[:MAX_DRM_ENTRIES]
    except OSError:
        return []
    cards = [n for n in names if re.fullmatch(r"card\d+", n)]
    renders = [n for n in names if re.fullmatch(r"renderD\d+", n)]
    return [f"/dev/dri/{n}" for n in (*cards, *renders)]
