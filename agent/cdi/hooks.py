"""The NVIDIA CDI hook binary (``nvidia-cdi-hook`` or ``nvidia-ctk hook``) and the hooks a spec runs.

The container runtime runs hooks on the host, so a spec must name the binary's *host* path,
while the agent can only look for it where it sees files. Where it is looked for, in order:

1. ``cdi.hook_path`` when set: written as given (a host path);
2. each candidate (``/usr/bin/nvidia-cdi-hook``, ...) under the driver root, written as the
   host sees that file (a driver root that is the host's ``/``, or a driver container that
   ships the toolkit);
3. each candidate under the host's ``/`` when the root mapping says where the agent sees it
   (:meth:`~agent.cdi.roots.RootMapping.visible_host_root`);
4. each candidate in the agent's own filesystem, assumed to be at the same path on the host
   (the agent running on the host, or a pod that mounts the toolkit directory at its path).

Hooks, in the order ``nvidia-ctk cdi generate`` writes them (toolkit 1.17.8 and later), each
``createContainer`` with ``NVIDIA_CTK_DEBUG=false`` in its environment:
``create-symlinks`` (``libcuda.so`` -> ``libcuda.so.1``), ``enable-cuda-compat
--host-driver-version=<driver>`` (CUDA forward compatibility: an image's newer
``cuda-compat`` libraries are used only when the host driver is older), ``update-ldcache``
(so images of another distribution find the injected libraries) and
``disable-device-node-modification`` (``libnvidia-ml`` and ``nvidia-smi`` in the container
must not create device nodes). A binary older than a subcommand would fail the container's
start, so the two newer subcommands are written only when the binary visibly contains their
names (a cheap scan, cached per file); a binary the agent cannot read gets the older two only.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import structlog

from agent.backends.driverroot import in_root, resolve_in_root
from agent.cdi.roots import RootMapping
from agent.cdi.spec import Hook

log = structlog.get_logger("agent.cdi")

#: host paths of the toolkit's hook binary, in order of preference (runtimes run hooks on the host)
HOOK_CANDIDATES = (
    Path("/usr/bin/nvidia-cdi-hook"),
    Path("/usr/local/bin/nvidia-cdi-hook"),
    Path("/usr/local/nvidia/toolkit/nvidia-cdi-hook"),
    Path("/usr/bin/nvidia-ctk"),
    Path("/usr/local/nvidia/toolkit/nvidia-ctk"),
)
HOOK_ENV = ("NVIDIA_CTK_DEBUG=false",)
ENABLE_CUDA_COMPAT = "enable-cuda-compat"
DISABLE_DEVICE_NODE_MODIFICATION = "disable-device-node-modification"
#: subcommands newer than the hook binary itself (toolkit 1.17.5 and 1.17.8)
NEWER_SUBCOMMANDS = (ENABLE_CUDA_COMPAT, DISABLE_DEVICE_NODE_MODIFICATION)
#: a hook binary larger than this is not scanned (nvidia-ctk is about 30 MiB)
MAX_SCAN_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class HookBinary:
    """The binary as the host sees it, and which of the newer subcommands it has."""

    host_path: Path
    subcommands: frozenset[str] = frozenset()

    @property
    def argv_prefix(self) -> tuple[str, ...]:
        name = self.host_path.name
        return (name, "hook") if name == "nvidia-ctk" else (name,)


class HookLocator:
    """Finds the hook binary; keeps the subcommand scan of each file it has read."""

    def __init__(
        self, roots: RootMapping, *, hook_path: Path | None = None, candidates: Iterable[Path] = HOOK_CANDIDATES
    ) -> None:
        self._roots = roots
        self._hook_path = hook_path
        self._candidates = tuple(candidates)
        self._scans: dict[tuple[str, int, int, int], frozenset[str]] = {}
        self._reported_unreadable = False

    @property
    def candidates(self) -> tuple[Path, ...]:
        return self._candidates

    def locate(self) -> HookBinary | None:
        """The binary to write into specs, or None: then a spec has no hooks. Blocking."""
        if self._hook_path is not None:
            seen = self._roots.agent_path(self._hook_path)
            if seen is None and self._roots.is_identity:
                seen = self._hook_path
            if seen is not None and _executable(seen):
                return HookBinary(self._hook_path, self._scan(seen))
            if not self._reported_unreadable:
                log.info(
                    "cdi.hook_not_inspected",
                    hook_path=str(self._hook_path),
                    action=f"written as configured, without {' and '.join(NEWER_SUBCOMMANDS)}",
                )
                self._reported_unreadable = True
            return HookBinary(self._hook_path)
        for candidate in self._candidates:
            found = self._find(candidate)
            if found is not None:
                seen, host = found
                return HookBinary(host, self._scan(seen))
        return None

    def _find(self, candidate: Path) -> tuple[Path, Path] | None:
        """(where the agent sees it, the host path) of ``candidate``, trying the places in order."""
        root = self._roots.container_root
        real = resolve_in_root(root, str(candidate))
        if real is not None:
            seen = in_root(root, real)
            if _executable(seen):
                return seen, Path(self._roots.host_path(str(seen)))
        visible = self._roots.visible_host_root()
        if visible is not None and visible != root:
            real = resolve_in_root(visible, str(candidate))
            if real is not None and _executable(in_root(visible, real)):
                return in_root(visible, real), candidate
        if _executable(candidate):
            return candidate, Path(self._roots.host_path(str(candidate)))
        return None

    def _scan(self, path: Path) -> frozenset[str]:
        """The newer subcommands whose names the binary contains (cached per file version)."""
        try:
            st = path.stat()
        except OSError:
            return frozenset()
        key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in self._scans:
            self._scans[key] = _subcommands_in(path, st.st_size)
        return self._scans[key]


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _subcommands_in(path: Path, size: int) -> frozenset[str]:
    if size <= 0 or size > MAX_SCAN_BYTES:
        return frozenset()
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return frozenset(name for name in NEWER_SUBCOMMANDS if data.find(name.encode()) >= 0)
    except (OSError, ValueError):
        return frozenset()


def _hook(binary: HookBinary, *args: str) -> Hook:
    return Hook("createContainer", str(binary.host_path), (*binary.argv_prefix, *args), env=HOOK_ENV)


def driver_hooks(binary: HookBinary, libraries: Sequence[str], version: str) -> tuple[Hook, ...]:
    """The spec-level hooks for the driver's ``libraries`` (container paths) of ``version``."""
    hooks: list[Hook] = []
    cuda = [p for p in libraries if PurePosixPath(p).name.startswith("libcuda.so.")]
    if cuda:
        hooks.append(
            _hook(binary, "create-symlinks", "--link", f"libcuda.so.1::{PurePosixPath(cuda[0]).parent}/libcuda.so")
        )
    if ENABLE_CUDA_COMPAT in binary.subcommands and version:
        hooks.append(_hook(binary, ENABLE_CUDA_COMPAT, f"--host-driver-version={version}"))
    folders: list[str] = []
    for d in dict.fromkeys(str(PurePosixPath(p).parent) for p in libraries):
        folders += ["--folder", d]
    hooks.append(_hook(binary, "update-ldcache", *folders))
    if DISABLE_DEVICE_NODE_MODIFICATION in binary.subcommands:
        hooks.append(_hook(binary, DISABLE_DEVICE_NODE_MODIFICATION))
    return tuple(hooks)


def symlink_hook(binary: HookBinary, links: Sequence[str]) -> Hook:
    """``create-symlinks`` for ``target::link`` pairs (a GPU's /dev/dri/by-path links)."""
    args: list[str] = []
    for link in links:
        args += ["--link", link]
    return _hook(binary, "create-symlinks", *args)
