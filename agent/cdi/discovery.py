"""What the NVIDIA driver under a driver root gives a container: nodes, files, hooks.

The driver root is ``/`` or a driver container's root (e.g. ``/run/nvidia/driver``). Paths
inside it are what a container sees; the same path prefixed with the root is the host
path. Device nodes are taken, in order, from ``<driver root>/dev`` when it has ``nvidiactl``
(a driver container's own nodes), from the host's live ``/dev`` when the agent sees the
host's ``/`` (:meth:`~agent.cdi.roots.RootMapping.visible_host_root`), and otherwise from
the agent's own ``/dev``. In a pod that last one is a copy made when the container was
created: nodes the driver creates later (``nvidia-uvm``, ``nvidia-caps``) are missing from it
until the pod restarts, which is logged once; mount the host's ``/`` to avoid it.

Everything is looked at under the root as the agent sees it (``driver_root``); every host
path put into a node, mount or hook goes through one :class:`~agent.cdi.roots.RootMapping`,
so a pod that mounts the host's ``/run/nvidia/driver`` at ``/driver-root`` writes specs
that name ``/run/nvidia/driver/...`` (``host_driver_root``). The hook binary is found by
:class:`~agent.cdi.hooks.HookLocator`.

Required: the root itself, one driver version (``libnvidia-ml.so.<version>``; when the root
holds several, the one NVML reports is used), ``libcuda.so.<version>`` and ``/dev/nvidiactl``;
without one of them :class:`DriverDiscoveryError` names the path. Everything else (control
nodes, DRM nodes, utilities, firmware, IPC sockets, the MPS pipe directory, the hook) is
optional, logged once when it goes missing and skipped. A GPU or MIG node that is missing is
left out of ``gpu_nodes``/``cap_nodes``, so no spec names hardware that is gone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import structlog

from agent.backends.driverroot import LIBRARY_DIRS, find_utility, in_root, library_listing, resolve_in_root
from agent.cdi.devnodes import GpuDrm, gpu_drm, stat_node
from agent.cdi.errors import DriverDiscoveryError
from agent.cdi.hooks import HOOK_CANDIDATES, HookBinary, HookLocator, driver_hooks, symlink_hook
from agent.cdi.roots import RootMapping
from agent.cdi.spec import ContainerEdits, DeviceNode, Hook, Mount
from agent.core.inventory.model import Gpu, MigDevice

__all__ = ["HOOK_CANDIDATES", "LIBRARY_DIRS", "DriverDiscovery", "DriverFiles", "resolve_in_root"]

log = structlog.get_logger("agent.cdi")

UTILITIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
CONTROL_NODES = ("/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")  # optional
CTL_NODE = "/dev/nvidiactl"  # required
IPC_SOCKETS = ("/run/nvidia-persistenced/socket", "/run/nvidia-fabricmanager/socket")
#: the MPS control daemon's default pipe directory: clients reach the daemon through it
MPS_PIPE_DIR = "/tmp/nvidia-mps"
FIRMWARE_DIRS = ("/lib/firmware/nvidia", "/usr/lib/firmware/nvidia")
READ_ONLY = ("ro", "nosuid", "nodev", "rbind", "rprivate")
IPC_OPTIONS = (*READ_ONLY, "noexec")
VISIBLE_DEVICES_VOID = "NVIDIA_VISIBLE_DEVICES=void"  # keeps the legacy runtime hook from acting too
#: where the injected libcuda lives in the container, for the enable-cuda-compat hook
LIBCUDA_DIR_ENV = "NVIDIA_CTK_LIBCUDA_DIR"

_VERSION = r"\d+\.\d+(?:\.\d+)?"
_ANCHOR = re.compile(rf"^lib(nvidia-ml|cuda)\.so\.({_VERSION})$")


def _versions(listing: Mapping[str, list[str]]) -> set[str]:
    return {m.group(2) for names in listing.values() for n in names if (m := _ANCHOR.match(n))}


def gpu_node_path(minor: int) -> str:
    return f"/dev/nvidia{minor}"


def cap_node_path(minor: int) -> str:
    return f"/dev/nvidia-caps/nvidia-cap{minor}"


@dataclass(frozen=True, slots=True)
class DriverFiles:
    """One look at the driver: everything a spec needs, nothing generated yet."""

    driver_root: Path
    dev_root: Path
    version: str
    control_nodes: tuple[DeviceNode, ...]  # nvidiactl first
    gpu_nodes: Mapping[int, DeviceNode]  # by /dev/nvidia<minor>
    cap_nodes: Mapping[int, DeviceNode]  # by /dev/nvidia-caps/nvidia-cap<minor>
    mounts: tuple[Mount, ...]
    hooks: tuple[Hook, ...]
    missing: tuple[str, ...] = field(default=())  # optional pieces that were skipped
    env: tuple[str, ...] = (VISIBLE_DEVICES_VOID,)
    drm: Mapping[str, GpuDrm] = field(default_factory=dict)  # by GPU bus id (sysfs form)
    hook: HookBinary | None = None

    def common_edits(self) -> ContainerEdits:
        """Edits every device of a spec needs: control nodes, libraries, utilities, hooks."""
        return ContainerEdits(
            env=self.env,
            device_nodes=self.control_nodes,
            mounts=self.mounts,
            hooks=self.hooks,
        )

    def gpu_edits(self, gpu: Gpu) -> ContainerEdits | None:
        """The GPU's node, its DRM nodes and by-path links; None when its node is missing on the host."""
        node = self.gpu_nodes.get(gpu.minor)
        if node is None:
            return None
        drm = self.drm.get(gpu.short_bus_id, GpuDrm())
        hooks = (symlink_hook(self.hook, drm.links),) if self.hook is not None and drm.links else ()
        return ContainerEdits(device_nodes=(node, *drm.nodes), hooks=hooks)

    def mig_edits(self, gpu: Gpu, mig: MigDevice) -> ContainerEdits | None:
        """The parent's node and the GI and CI capability nodes; None when one is missing."""
        if mig.gi_cap_minor is None or mig.ci_cap_minor is None:
            return None
        nodes = (
            self.gpu_nodes.get(gpu.minor),
            self.cap_nodes.get(mig.gi_cap_minor),
            self.cap_nodes.get(mig.ci_cap_minor),
        )
        present = tuple(n for n in nodes if n is not None)
        return ContainerEdits(device_nodes=present) if len(present) == len(nodes) else None


class DriverDiscovery:
    """Looks at a driver root. Keeps which optional pieces it already reported missing.

    ``sysfs_root`` is where the GPUs' DRM nodes are listed (``/sys``; a tree in tests).
    """

    def __init__(
        self,
        driver_root: Path,
        *,
        host_driver_root: Path | None = None,
        hook_path: Path | None = None,
        hook_candidates: Iterable[Path] = HOOK_CANDIDATES,
        machine: str | None = None,
        sysfs_root: Path = Path("/sys"),
    ) -> None:
        self.driver_root = driver_root
        self.roots = RootMapping(driver_root, host_driver_root if host_driver_root is not None else driver_root)
        self._hooks = HookLocator(self.roots, hook_path=hook_path, candidates=hook_candidates)
        self._machine = machine
        self._sysfs_root = sysfs_root
        self._reported: set[str] = set()
        self._said: set[str] = set()  # one-time notes already logged

    # -- entry point ----------------------------------------------------------------------

    def discover(
        self,
        gpu_minors: Iterable[int] = (),
        cap_minors: Iterable[int] = (),
        *,
        buses: Iterable[str] = (),
        driver_version: str = "",
    ) -> DriverFiles:
        """Blocking file I/O: call through ``asyncio.to_thread`` from the loop.

        ``buses``: the GPUs' PCI bus ids (for their DRM nodes); ``driver_version``: the
        version NVML reports, which picks the libraries when the root holds several.
        """
        root = self.driver_root
        if not root.is_dir():
            raise DriverDiscoveryError(f"driver root {root} does not exist or is not a directory")
        missing: list[str] = []
        dev_root = self._dev_root()
        libraries, version, links = self._libraries(root, driver_version)
        ctl = stat_node(dev_root, CTL_NODE, self.roots)
        if ctl is None:
            raise DriverDiscoveryError(f"required device node {dev_root / CTL_NODE.lstrip('/')} is missing")
        controls = [ctl]
        for path in CONTROL_NODES:
            node = stat_node(dev_root, path, self.roots)
            if node is None:
                missing.append(str(dev_root / path.lstrip("/")))
            else:
                controls.append(node)
        gpu_nodes = self._nodes(dev_root, {m: gpu_node_path(m) for m in gpu_minors}, missing)
        cap_nodes = self._nodes(dev_root, {m: cap_node_path(m) for m in cap_minors}, missing)
        drm = {bus: gpu_drm(self._sysfs_root, dev_root, bus, self.roots, missing) for bus in buses}
        hook = self._hooks.locate()
        if hook is None:
            missing.extend(str(c) for c in self._hooks.candidates[:1])
        mounts = [self._mount(root, p) for p in libraries]
        if hook is None:  # without the ldcache hook, the SONAME links must arrive as files
            mounts.extend(self._mount(root, p) for p in links)
        mounts.extend(self._utilities(root, missing))
        mounts.extend(self._firmware(root, version, missing))
        mounts.extend(self._ipc(root, missing))
        hooks = driver_hooks(hook, libraries, version) if hook is not None else ()
        self._report(missing)
        return DriverFiles(
            driver_root=root,
            dev_root=dev_root,
            version=version,
            control_nodes=tuple(controls),
            gpu_nodes=gpu_nodes,
            cap_nodes=cap_nodes,
            mounts=tuple(mounts),
            hooks=hooks,
            missing=tuple(missing),
            env=self._env(libraries),
            drm=drm,
            hook=hook,
        )

    def _dev_root(self) -> Path:
        """Where device nodes are stat'ed: the driver root's, the host's live /dev, or our own."""
        root = self.driver_root
        if (root / CTL_NODE.lstrip("/")).exists():
            return root
        visible = self.roots.visible_host_root()
        if visible is not None and (visible / CTL_NODE.lstrip("/")).exists():
            return visible
        if root != Path("/"):
            self._once(
                "pod-dev",
                "cdi.device_nodes_from_own_dev",
                reason=f"no {CTL_NODE} under {root}, and the host's / is not visible",
                action="using this container's /dev, which misses nodes created after it started",
            )
        return Path("/")

    def _once(self, key: str, event: str, **fields: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning(event, **fields)

    # -- libraries --------------------------------------------------------------------------

    def installed_versions(self) -> set[str]:
        """Driver versions whose ``libnvidia-ml``/``libcuda`` lie under the root; empty: no driver.

        Blocking, but cheap (the linker cache and a few directory listings). A root that does
        not exist raises DriverDiscoveryError: it is a wrong path, not a node without a driver.
        """
        root = self.driver_root
        if not root.is_dir():
            raise DriverDiscoveryError(f"driver root {root} does not exist or is not a directory")
        return _versions(library_listing(root, self._machine).directories)

    def _pick_version(self, root: Path, versions: set[str], looked: str, driver_version: str) -> str:
        if not versions:
            raise DriverDiscoveryError(f"no NVIDIA driver libraries (libnvidia-ml.so.<version>) found in {looked}")
        if len(versions) == 1:
            version = next(iter(versions))
            if driver_version and driver_version != version:
                self._once(
                    f"mismatch {driver_version} {version}",
                    "cdi.driver_version_mismatch",
                    nvml=driver_version,
                    libraries=version,
                    action="using the libraries' version (a driver upgrade in progress?)",
                )
            return version
        listed = ", ".join(sorted(versions))
        if driver_version in versions:
            self._once(
                f"several {listed}",
                "cdi.several_driver_versions",
                versions=listed,
                chosen=driver_version,
                reason="the version NVML reports",
            )
            return driver_version
        running = f"; NVML reports {driver_version}" if driver_version else ""
        raise DriverDiscoveryError(
            f"driver root {root} holds more than one NVIDIA driver version ({listed}){running}; "
            "remove the stale one or point paths.driver_root at one driver"
        )

    def _libraries(self, root: Path, driver_version: str) -> tuple[list[str], str, list[str]]:
        """(versioned driver libraries, the driver version, links to them) as container paths."""
        found = library_listing(root, self._machine)
        cached, listing = list(found.cached), found.directories
        looked = ", ".join(str(in_root(root, d)) for d in listing) or f"{root} (no library directories)"
        version = self._pick_version(root, _versions(listing), looked, driver_version)
        suffix = f".so.{version}"
        libraries = [
            f"{d}/{n}" for d, names in listing.items() for n in names if n.startswith("lib") and n.endswith(suffix)
        ]
        libraries += [p for p in cached if p.endswith(suffix) and p not in libraries]
        real_files = {resolve_in_root(root, p) for p in libraries}
        libraries = [p for p in libraries if resolve_in_root(root, p) == p]  # the files, not links to them
        for required in ("libnvidia-ml", "libcuda"):
            if not any(PurePosixPath(p).name == f"{required}{suffix}" for p in libraries):
                raise DriverDiscoveryError(f"required driver library {required}{suffix} not found in {looked}")
        candidates = [f"{d}/{n}" for d, names in listing.items() for n in names] + cached
        links = sorted(
            {p for p in candidates if p not in libraries and ".so" in p and resolve_in_root(root, p) in real_files}
        )
        return sorted(set(libraries)), version, links

    @staticmethod
    def _env(libraries: list[str]) -> tuple[str, ...]:
        cuda_dirs = dict.fromkeys(
            str(PurePosixPath(p).parent) for p in libraries if PurePosixPath(p).name.startswith("libcuda.so.")
        )
        return (f"{LIBCUDA_DIR_ENV}={':'.join(cuda_dirs)}", VISIBLE_DEVICES_VOID)

    # -- other files ------------------------------------------------------------------------

    def _mount(self, root: Path, path: str, options: tuple[str, ...] = READ_ONLY) -> Mount:
        real = resolve_in_root(root, path) or path
        host_path = self.roots.host_path(str(in_root(root, real)))
        return Mount(host_path=host_path, container_path=path, options=options)

    def _utilities(self, root: Path, missing: list[str]) -> list[Mount]:
        out: list[Mount] = []
        for name in UTILITIES:
            path = find_utility(root, name)
            if path is not None:
                out.append(self._mount(root, path))
            else:
                missing.append(f"{root / 'usr/bin' / name}")
        return out

    def _firmware(self, root: Path, version: str, missing: list[str]) -> list[Mount]:
        for base in FIRMWARE_DIRS:
            directory = f"{base}/{version}"
            real = resolve_in_root(root, directory)
            if real is None:
                continue
            files = sorted(p.name for p in in_root(root, real).glob("gsp*.bin") if p.is_file())
            if files:
                return [self._mount(root, f"{directory}/{name}") for name in files]
        missing.append(str(root / FIRMWARE_DIRS[0].lstrip("/") / version / "gsp*.bin"))
        return []

    def _ipc(self, root: Path, missing: list[str]) -> list[Mount]:
        """The persistenced and fabric manager sockets, and the MPS pipe directory."""
        out: list[Mount] = []
        for path in IPC_SOCKETS:
            for prefix in ("", "/var"):
                if resolve_in_root(root, prefix + path) is not None:
                    out.append(self._mount(root, prefix + path, IPC_OPTIONS))
                    break
            else:
                missing.append(str(root / path.lstrip("/")))
        real = resolve_in_root(root, MPS_PIPE_DIR)
        if real is not None and in_root(root, real).is_dir():
            out.append(self._mount(root, MPS_PIPE_DIR, IPC_OPTIONS))
        else:
            missing.append(str(in_root(root, MPS_PIPE_DIR)))
        return out

    # -- device nodes -----------------------------------------------------------------------

    def _nodes(self, dev_root: Path, wanted: Mapping[int, str], missing: list[str]) -> dict[int, DeviceNode]:
        out: dict[int, DeviceNode] = {}
        for minor, path in sorted(wanted.items()):
            node = stat_node(dev_root, path, self.roots)
            if node is None:
                missing.append(str(dev_root / path.lstrip("/")))
            else:
                out[minor] = node
        return out

    def _report(self, missing: list[str]) -> None:
        now = set(missing)
        for path in sorted(now - self._reported):
            log.warning("cdi.optional_missing", path=path, action="skipped")
        for path in sorted(self._reported - now):
            log.info("cdi.optional_found", path=path)
        self._reported = now
