"""Device nodes for specs: stat'ed where the agent sees them, named where the host has them.

Also the DRM nodes of one GPU (``/dev/dri/card*`` and ``renderD*``, found through sysfs as
nvidia-container-toolkit does) and the ``/dev/dri/by-path`` links that graphics stacks
(Vulkan, EGL) use to find a GPU's nodes by PCI address: a container does not get those links
from the runtime, so they are made by the hook (``create-symlinks``), exactly like the
toolkit's ``--link ../card1::/dev/dri/by-path/pci-0000:18:00.0-card``.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from agent.backends import sysfs
from agent.cdi.roots import RootMapping
from agent.cdi.spec import DeviceNode

BY_PATH = "/dev/dri/by-path"


def stat_node(dev_root: Path, path: str, roots: RootMapping) -> DeviceNode | None:
    """The character or block node ``path`` (a container path) under ``dev_root``; None when absent."""
    host = dev_root / path.lstrip("/")
    try:
        st = host.stat()
    except OSError:
        return None
    if stat.S_ISCHR(st.st_mode):
        kind = "c"
    elif stat.S_ISBLK(st.st_mode):
        kind = "b"
    else:
        return None
    on_host = roots.host_path(str(host))
    host_path = on_host if on_host != path else None
    return DeviceNode(path=path, host_path=host_path, type=kind, major=os.major(st.st_rdev), minor=os.minor(st.st_rdev))


@dataclass(frozen=True, slots=True)
class GpuDrm:
    """One GPU's DRM nodes and the by-path links to them (``target::link`` hook arguments)."""

    nodes: tuple[DeviceNode, ...] = ()
    links: tuple[str, ...] = ()


def gpu_drm(sysfs_root: Path, dev_root: Path, bus_id: str, roots: RootMapping, missing: list[str]) -> GpuDrm:
    """The DRM nodes sysfs lists for the GPU at ``bus_id`` that exist under ``dev_root``."""
    nodes: list[DeviceNode] = []
    for path in sysfs.drm_nodes(sysfs_root, bus_id):
        node = stat_node(dev_root, path, roots)
        if node is None:
            missing.append(str(dev_root / path.lstrip("/")))
        else:
            nodes.append(node)
    names = {Path(n.path).name for n in nodes}
    links: list[str] = []
    bus = sysfs.sysfs_bus_id(bus_id)
    for suffix in ("card", "render"):
        link = f"{BY_PATH}/pci-{bus}-{suffix}"
        try:
            target = os.readlink(dev_root / link.lstrip("/"))
        except OSError:
            continue
        name = Path(target).name
        if name in names and target in (f"../{name}", f"/dev/dri/{name}"):  # udev's form; nothing else
            links.append(f"{target}::{link}")
    return GpuDrm(nodes=tuple(nodes), links=tuple(links))
