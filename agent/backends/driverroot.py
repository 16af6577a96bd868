"""Finding the NVIDIA driver's files under a driver root, without running anything from it.

The driver root is ``/`` or a driver container's root as the agent sees it (e.g. the host's
``/run/nvidia/driver`` mounted at ``/driver-root``). Paths inside it are absolute as seen from
the root; symlinks are followed as if the root were ``/`` (a driver container's links are
absolute inside its own root). Libraries are found the way the loader would: through the
root's linker cache (``etc/ld.so.cache``), and when the cache does not know the driver, by
listing the usual library directories.

Both the NVML backend (which loads ``libnvidia-ml.so.1`` from here) and CDI discovery (which
mounts the driver's libraries into containers) use this one lookup, so they never disagree
about which driver a node has.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import structlog

from agent.backends import ldcache

log = structlog.get_logger("agent.driverroot")

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
#: where the driver's programs (nvidia-smi, nvidia-cuda-mps-control, ...) are installed
UTILITY_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin")
#: the driver's anchor libraries: a directory holding one of them holds the driver
DRIVER_LIBRARY_PREFIXES = ("libnvidia-ml.so", "libcuda.so")
#: symlink hops followed before a path counts as unresolvable (the kernel's limit is 40)
MAX_LINK_HOPS = 40


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
            if hops > MAX_LINK_HOPS:
                return None
            try:
                target = PurePosixPath(os.readlink(host))
            except OSError:
                return None
            if target.is_absolute():
                current = PurePosixPath("/")
            parts = list(target.parts[1:] if target.is_absolute() else target.parts) + parts
            continue
        current = candidate
    return str(current)


def in_root(root: Path, path: str) -> Path:
    """Where the agent sees the root-relative absolute ``path``."""
    return root / path.lstrip("/")


@dataclass(frozen=True, slots=True)
class LibraryListing:
    """One look at the root's libraries: the linker cache's paths and the listed directories."""

    cached: tuple[str, ...]  # absolute paths inside the root, in the cache's (search) order
    directories: dict[str, list[str]]  # directory inside the root -> file names


def cached_libraries(root: Path, machine: str | None = None) -> list[str]:
    """Paths of this machine's libraries in the root's linker cache; empty without a cache."""
    cache = root / "etc/ld.so.cache"
    try:
        data = cache.read_bytes()
    except OSError:
        return []
    try:
        entries = ldcache.native_libraries(ldcache.parse(data), machine)
    except ldcache.LdCacheError as exc:
        log.warning("driverroot.ldcache_unreadable", path=str(cache), error=str(exc), action="scanning library dirs")
        return []
    return [e.path for e in entries]


def library_listing(root: Path, machine: str | None = None) -> LibraryListing:
    """The directories that may hold the driver, listed: those the cache names, else the usual ones."""
    cached = cached_libraries(root, machine)
    dirs: list[str] = []
    for path in cached:
        if PurePosixPath(path).name.startswith(DRIVER_LIBRARY_PREFIXES):
            real = resolve_in_root(root, path)
            if real is not None:
                dirs.append(str(PurePosixPath(real).parent))
    if not dirs:  # no cache, or a cache that does not know the driver: scan the usual places
        dirs = [d for d in LIBRARY_DIRS if resolve_in_root(root, d) is not None]
    dirs = list(dict.fromkeys(resolve_in_root(root, d) or d for d in dirs))
    listing: dict[str, list[str]] = {}
    for d in dirs:
        try:
            listing[d] = sorted(os.listdir(in_root(root, d)))
        except OSError:
            continue
    return LibraryListing(cached=tuple(cached), directories=listing)


@dataclass(frozen=True, slots=True)
class LibrarySearch:
    """Where a library was looked for under a root, and what was found."""

    name: str
    root: Path
    found: Path | None  # where the agent sees the library's file (symlinks resolved in the root)
    looked_in: tuple[str, ...]  # agent-visible places, for messages

    def describe(self) -> str:
        if self.found is not None:
            return f"{self.name} found at {self.found}"
        where = ", ".join(self.looked_in) or f"{self.root} (no linker cache, no library directories)"
        return f"{self.name} not found under {self.root} (looked in {where})"


def find_library(root: Path, name: str, machine: str | None = None) -> LibrarySearch:
    """The file ``name`` (a SONAME such as ``libnvidia-ml.so.1``) resolves to under ``root``.

    The linker cache is asked first, then the usual library directories. Blocking: a cache
    read and a few stats.
    """
    looked: list[str] = []
    if not root.is_dir():
        return LibrarySearch(name=name, root=root, found=None, looked_in=(f"{root} (not a directory)",))
    cache = root / "etc/ld.so.cache"
    cached = cached_libraries(root, machine)
    if cached:
        looked.append(str(cache))
    candidates = [p for p in cached if PurePosixPath(p).name == name]
    candidates += [f"{d}/{name}" for d in LIBRARY_DIRS]
    for path in candidates:
        real = resolve_in_root(root, path)
        if real is not None and in_root(root, real).is_file():
            return LibrarySearch(name=name, root=root, found=in_root(root, real), looked_in=tuple(looked))
    looked.extend(str(in_root(root, d)) for d in LIBRARY_DIRS if resolve_in_root(root, d) is not None)
    return LibrarySearch(name=name, root=root, found=None, looked_in=tuple(looked))


def find_utility(root: Path, name: str) -> str | None:
    """The driver program ``name`` (e.g. ``nvidia-smi``) under ``root``: the path inside the root it
    was found at (``/usr/bin/nvidia-smi``; symlinks not resolved), or None. Blocking: a few stats."""
    for directory in UTILITY_DIRS:
        path = f"{directory}/{name}"
        real = resolve_in_root(root, path)
        if real is not None and in_root(root, real).is_file():
            return path
    return None
