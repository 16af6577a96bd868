"""What the NVIDIA driver under a driver root gives a container: nodes, files, hooks.

The driver root is ``/`` or a driver container's root (e.g. ``/run/nvidia/driver``). Paths
inside it are what a container sees; the same path prefixed with the root is the host
path. Device nodes live under the driver root when it has ``dev/nvidiactl``, otherwise
under the host's ``/dev`` (a driver container creates its nodes on the host).

Everything is looked at under the root as the agent sees it (``driver_root``); every host
path put into a node, mount or hook goes through one :class:`~agent.cdi.roots.RootMapping`,
so a pod that mounts the host's ``/run/nvidia/driver`` at ``/driver-root`` writes specs
that name ``/run/nvidia/driver/...`` (``host_driver_root``). The hook binary is the host's
``hook_path`` when one is configured (taken as given: the agent may not see it), else the
first executable of ``hook_candidates``.

Required: the root itself, exactly one driver version (``libnvidia-ml.so.<version>``),
``libcuda.so.<version>`` and ``/dev/nvidiactl``; without one of them
:class:`DriverDiscoveryError` names the path. Everything else is optional, logged once
when it goes missing and skipped. A GPU or MIG node that is missing is left out of
``gpu_nodes``/``cap_nodes``, so no spec names hardware that is gone.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import structlog

from agent.cdi import ldcache
from agent.cdi.errors import DriverDiscoveryError
from agent.cdi.roots import RootMapping
from agent.cdi.spec import ContainerEdits, DeviceNode, Hook, Mount
from agent.inventory.model import Gpu, MigDevice

log = structlog.get_logger("agent.cdi")

LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/lib64",
    "/usr/lib",
    "/usr/local/nvidia/lib64",
)
UTILITIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
UTILITY_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin")
CONTROL_NODES = ("/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")  # optional
CTL_NODE = "/dev/nvidiactl"  # required
IPC_SOCKETS = ("/run/nvidia-persistenced/socket", "/run/nvidia-fabricmanager/socket")
FIRMWARE_DIRS = ("/lib/firmware/nvidia", "/usr/lib/firmware/nvidia")
#: host paths of the toolkit's hook binary, in order of preference (runtimes run hooks on the host)
HOOK_CANDIDATES = (
    Path("/usr/bin/nvidia-cdi-hook"),
    Path("/usr/local/bin/nvidia-cdi-hook"),
    Path("/usr/local/nvidia/toolkit/nvidia-cdi-hook"),
    Path("/usr/bin/nvidia-ctk"),
    Path("/usr/local/nvidia/toolkit/nvidia-ctk"),
)
READ_ONLY = ("ro", "nosuid", "nodev", "rbind", "rprivate")
IPC_OPTIONS = (*READ_ONLY, "noexec")
VISIBLE_DEVICES_VOID = "NVIDIA_VISIBLE_DEVICES=void"  # keeps the legacy runtime hook from acting too

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

    def common_edits(self) -> ContainerEdits:
        """Edits every device of a spec needs: control nodes, libraries, utilities, hooks."""
        return ContainerEdits(
            env=(VISIBLE_DEVICES_VOID,),
            device_nodes=self.control_nodes,
            mounts=self.mounts,
            hooks=self.hooks,
        )

    def gpu_edits(self, gpu: Gpu) -> ContainerEdits | None:
        """The GPU's node; None when it is missing on the host."""
        node = self.gpu_nodes.get(gpu.minor)
        return ContainerEdits(device_nodes=(node,)) if node is not None else None

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


def resolve_in_root(root: Path, path: str) -> str | None:
    """``path`` with symlinks followed as if ``root`` were ``/``; None if it does not exist."""
    parts = list(PurePosixPath(path).parts[1:])
    current = PurePosixPath("/")
    hops = 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent
            continue
        candidate = current / part
        host = root / str(candidate).lstrip("/")
        try:
            mode = host.lstat().st_mode
        except OSError:
            return None
        if stat.S_ISLNK(mode):
            hops += 1
            if hops > 40:
                return None
            target = PurePosixPath(os.readlink(host))
            if target.is_absolute():
                current = PurePosixPath("/")
            parts = list(target.parts[1:] if target.is_absolute() else target.parts) + parts
            continue
        current = candidate
    return str(current)


class DriverDiscovery:
    """Looks at a driver root. Keeps which optional pieces it already reported missing."""

    def __init__(
        self,
        driver_root: Path,
        *,
        host_driver_root: Path | None = None,
        hook_path: Path | None = None,
        hook_candidates: Iterable[Path] = HOOK_CANDIDATES,
        machine: str | None = None,
    ) -> None:
        self.driver_root = driver_root
        self.roots = RootMapping(driver_root, host_driver_root if host_driver_root is not None else driver_root)
        self._hook_path = hook_path
        self._hook_candidates = tuple(hook_candidates)
        self._machine = machine
        self._reported: set[str] = set()

    # -- entry point ----------------------------------------------------------------------

    def discover(self, gpu_minors: Iterable[int] = (), cap_minors: Iterable[int] = ()) -> DriverFiles:
        """Blocking file I/O: call through ``asyncio.to_thread`` from the loop."""
        root = self.driver_root
        if not root.is_dir():
            raise DriverDiscoveryError(f"driver root {root} does not exist or is not a directory")
        missing: list[str] = []
        dev_root = root if (root / CTL_NODE.lstrip("/")).exists() else Path("/")
        libraries, version, links = self._libraries(root)
        ctl = self._node(dev_root, CTL_NODE)
        if ctl is None:
            raise DriverDiscoveryError(f"required device node {dev_root / CTL_NODE.lstrip('/')} is missing")
        controls = [ctl]
        for path in CONTROL_NODES:
            node = self._node(dev_root, path)
            if node is None:
                missing.append(str(dev_root / path.lstrip("/")))
            else:
                controls.append(node)
        gpu_nodes = self._nodes(dev_root, {m: gpu_node_path(m) for m in gpu_minors}, missing)
        cap_nodes = self._nodes(dev_root, {m: cap_node_path(m) for m in cap_minors}, missing)
        hook = self._hook_binary(missing)
        mounts = [self._mount(root, p) for p in libraries]
        if hook is None:  # without the ldcache hook, the SONAME links must arrive as files
            mounts.extend(self._mount(root, p) for p in links)
        mounts.extend(self._utilities(root, missing))
        mounts.extend(self._firmware(root, version, missing))
        mounts.extend(self._sockets(root, missing))
        hooks = self._hooks(hook, libraries) if hook is not None else ()
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
        )

    # -- libraries --------------------------------------------------------------------------

    def _cache_paths(self, root: Path) -> list[str]:
        cache = root / "etc/ld.so.cache"
        try:
            data = cache.read_bytes()
        except OSError:
            return []
        try:
            entries = ldcache.native_libraries(ldcache.parse(data), self._machine)
        except ldcache.LdCacheError as exc:
            log.warning("cdi.ldcache_unreadable", path=str(cache), error=str(exc), action="scanning library dirs")
            return []
        return [e.path for e in entries]

    def installed_versions(self) -> set[str]:
        """Driver versions whose ``libnvidia-ml``/``libcuda`` lie under the root; empty: no driver.

        Blocking, but cheap (the linker cache and a few directory listings). A root that does
        not exist raises DriverDiscoveryError: it is a wrong path, not a node without a driver.
        """
        root = self.driver_root
        if not root.is_dir():
            raise DriverDiscoveryError(f"driver root {root} does not exist or is not a directory")
        _, listing = self._library_listing(root)
        return _versions(listing)

    def _library_listing(self, root: Path) -> tuple[list[str], dict[str, list[str]]]:
        """(linker cache paths, {library dir: file names}) of the directories that may hold the driver."""
        cached = self._cache_paths(root)
        dirs: list[str] = []
        for path in cached:
            name = PurePosixPath(path).name
            if name.startswith(("libnvidia-ml.so", "libcuda.so")):
                real = resolve_in_root(root, path)
                if real is not None:
                    dirs.append(str(PurePosixPath(real).parent))
        if not dirs:  # no cache, or a cache that does not know the driver: scan the usual places
            dirs = [d for d in LIBRARY_DIRS if resolve_in_root(root, d) is not None]
        dirs = list(dict.fromkeys(resolve_in_root(root, d) or d for d in dirs))
        listing: dict[str, list[str]] = {}
        for d in dirs:
            try:
                listing[d] = sorted(os.listdir(root / d.lstrip("/")))
            except OSError:
                continue
        return cached, listing

    def _libraries(self, root: Path) -> tuple[list[str], str, list[str]]:
        """(versioned driver libraries, the driver version, links to them) as container paths."""
        cached, listing = self._library_listing(root)
        versions = _versions(listing)
        if not versions:
            looked = ", ".join(str(root / d.lstrip("/")) for d in listing) or f"{root} (no library directories)"
            raise DriverDiscoveryError(f"no NVIDIA driver libraries (libnvidia-ml.so.<version>) found in {looked}")
        if len(versions) > 1:
            raise DriverDiscoveryError(
                f"driver root {root} holds more than one NVIDIA driver version ({', '.join(sorted(versions))}); "
                "remove the stale one or point paths.driver_root at one driver"
            )
        version = versions.pop()
        suffix = f".so.{version}"
        libraries = [
            f"{d}/{n}" for d, names in listing.items() for n in names if n.startswith("lib") and n.endswith(suffix)
        ]
        libraries += [p for p in cached if p.endswith(suffix) and p not in libraries]
        real_files = {resolve_in_root(root, p) for p in libraries}
        libraries = [p for p in libraries if resolve_in_root(root, p) == p]  # the files, not links to them
        for required in ("libnvidia-ml", "libcuda"):
            if not any(PurePosixPath(p).name == f"{required}{suffix}" for p in libraries):
                where = ", ".join(str(root / d.lstrip("/")) for d in listing)
                raise DriverDiscoveryError(f"required driver library {required}{suffix} not found in {where}")
        candidates = [f"{d}/{n}" for d, names in listing.items() for n in names] + cached
        links = sorted(
            {p for p in candidates if p not in libraries and ".so" in p and resolve_in_root(root, p) in real_files}
        )
        return sorted(set(libraries)), version, links

    # -- other files ------------------------------------------------------------------------

    def _mount(self, root: Path, path: str, options: tuple[str, ...] = READ_ONLY) -> Mount:
        real = resolve_in_root(root, path) or path
        host_path = self.roots.host_path(str(root / real.lstrip("/")))
        return Mount(host_path=host_path, container_path=path, options=options)

    def _utilities(self, root: Path, missing: list[str]) -> list[Mount]:
        out: list[Mount] = []
        for name in UTILITIES:
            for d in UTILITY_DIRS:
                path = f"{d}/{name}"
                real = resolve_in_root(root, path)
                if real is not None and (root / real.lstrip("/")).is_file():
                    out.append(self._mount(root, path))
                    break
            else:
                missing.append(f"{root / 'usr/bin' / name}")
        return out

    def _firmware(self, root: Path, version: str, missing: list[str]) -> list[Mount]:
        for base in FIRMWARE_DIRS:
            directory = f"{base}/{version}"
            real = resolve_in_root(root, directory)
            if real is None:
                continue
            files = sorted(p.name for p in (root / real.lstrip("/")).glob("gsp*.bin") if p.is_file())
            if files:
                return [self._mount(root, f"{directory}/{name}") for name in files]
        missing.append(str(root / FIRMWARE_DIRS[0].lstrip("/") / version / "gsp*.bin"))
        return []

    def _sockets(self, root: Path, missing: list[str]) -> list[Mount]:
        out: list[Mount] = []
        for path in IPC_SOCKETS:
            for prefix in ("", "/var"):
                if resolve_in_root(root, prefix + path) is not None:
                    out.append(self._mount(root, prefix + path, IPC_OPTIONS))
                    break
            else:
                missing.append(str(root / path.lstrip("/")))
        return out

    def _hook_binary(self, missing: list[str]) -> Path | None:
        """The hook binary's path on the host, or None: without it there are no hooks."""
        if self._hook_path is not None:
            return self._hook_path
        for candidate in self._hook_candidates:
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return Path(self.roots.host_path(str(candidate)))
        missing.extend(str(c) for c in self._hook_candidates[:1])
        return None

    @staticmethod
    def _hooks(binary: Path, libraries: list[str]) -> tuple[Hook, ...]:
        argv0 = binary.name
        prefix = (argv0, "hook") if argv0 == "nvidia-ctk" else (argv0,)
        hooks: list[Hook] = []
        cuda = [p for p in libraries if PurePosixPath(p).name.startswith("libcuda.so.")]
        if cuda:
            link = f"libcuda.so.1::{PurePosixPath(cuda[0]).parent}/libcuda.so"
            hooks.append(Hook("createContainer", str(binary), (*prefix, "create-symlinks", "--link", link)))
        folders: list[str] = []
        for d in dict.fromkeys(str(PurePosixPath(p).parent) for p in libraries):
            folders += ["--folder", d]
        hooks.append(Hook("createContainer", str(binary), (*prefix, "update-ldcache", *folders)))
        return tuple(hooks)

    # -- device nodes -----------------------------------------------------------------------

    def _node(self, dev_root: Path, path: str) -> DeviceNode | None:
        """Stat'ed where the agent sees it; the spec names it where the host does."""
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
        on_host = self.roots.host_path(str(host))
        host_path = on_host if on_host != path else None
        return DeviceNode(
            path=path, host_path=host_path, type=kind, major=os.major(st.st_rdev), minor=os.minor(st.st_rdev)
        )

    def _nodes(self, dev_root: Path, wanted: Mapping[int, str], missing: list[str]) -> dict[int, DeviceNode]:
        out: dict[int, DeviceNode] = {}
        for minor, path in sorted(wanted.items()):
            node = self._node(dev_root, path)
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
