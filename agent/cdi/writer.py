"""Putting spec files into the CDI directory without ever damaging what is there.

* Writes are atomic (:func:`agent.base.atomicfile.replace_file`): a hidden temp file in the same
  directory (runtimes only read names ending in ``.json``/``.yaml``), fsync, rename over the
  target, fsync the directory. A failed write (read-only, full disk) leaves the previous file as
  it was. Claim specs are written and removed with ``durable=False`` (no fsync): the DRA
  checkpoint is their durable record, and the reconciler rebuilds them from it.
* Files are 0644, a directory the writer creates is 0755.
* The writer owns exactly the files named after its kinds (``<vendor>-<class>.json`` and
  ``<vendor>-<class>_<id>.json``); it refuses to write or remove any other name, and it
  refuses to replace or follow a symlink (or anything not a regular file) at a target.
* Before writing it reads every other spec in the directory: a file that already defines
  one of the new spec's qualified names would make the runtime drop both, so the write is
  refused with a SpecConflictError naming that file.
* It remembers what it left in each file it wrote (a digest of the content), or that it removed
  it, so the service can tell its own writes, which a directory watch reports a moment later,
  from someone else's change (:meth:`SpecWriter.left_as_is`).

All methods block (file I/O); the service calls them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

from agent.base.atomicfile import fsync_directory, replace_file, temp_target
from agent.cdi import spec as cdi_spec
from agent.cdi.errors import InvalidSpecError, SpecConflictError, SpecWriteError
from agent.cdi.names import SPEC_SUFFIX, SPEC_SUFFIXES, spec_file_name, transient_prefix

FILE_MODE = 0o644
DIR_MODE = 0o755
#: files whose state after the writer's last touch is remembered; past this the memory starts
#: afresh (a file then forgotten only costs one reconcile pass that finds nothing to do)
MAX_REMEMBERED = 4096

#: what :meth:`SpecWriter.left_as_is` remembers of a file: its length and a digest of its
#: content; None: no file
Left = tuple[int, bytes] | None


def _fingerprint(data: bytes) -> tuple[int, bytes]:
    return len(data), hashlib.blake2b(data, digest_size=16).digest()


def _reason(exc: OSError) -> str:
    if exc.errno == errno.EROFS:
        return "the file system is read-only"
    if exc.errno == errno.ENOSPC:
        return "no space left on device"
    return exc.strerror or str(exc)


def ensure_directory(directory: Path) -> None:
    if directory.is_dir():
        return
    if directory.exists() or directory.is_symlink():
        raise SpecWriteError(f"CDI directory {directory} exists but is not a directory")
    try:
        directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        os.chmod(directory, DIR_MODE)  # mkdir's mode is filtered by the umask
    except OSError as exc:
        raise SpecWriteError(f"cannot create CDI directory {directory}: {_reason(exc)}") from exc


def check_target(path: Path) -> bool:
    """True if ``path`` is a regular file, False if absent; SpecWriteError for anything else."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise SpecWriteError(f"cannot inspect {path}: {_reason(exc)}") from exc
    if stat.S_ISLNK(mode):
        raise SpecWriteError(f"refusing to touch {path}: it is a symlink (planted by someone else?)")
    if not stat.S_ISREG(mode):
        raise SpecWriteError(f"refusing to touch {path}: it is not a regular file")
    return True


def atomic_write(path: Path, data: bytes, *, mode: int = FILE_MODE, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically; on failure the old file is untouched.

    ``durable=False``: no fsync (see :mod:`agent.base.atomicfile`).
    """
    check_target(path)
    try:
        replace_file(path, data, mode=mode, durable=durable)
    except OSError as exc:
        raise SpecWriteError(f"cannot write {path}: {_reason(exc)}") from exc


def read_spec_file(path: Path) -> cdi_spec.Spec:
    """Parse a spec file (JSON or YAML by extension); InvalidSpecError when it does not parse."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidSpecError(f"cannot read: {exc}") from exc
    return cdi_spec.loads(text, yaml_format=path.suffix == ".yaml")


def spec_files(directory: Path) -> list[Path]:
    """Files a runtime would load from ``directory`` (no recursion, .json and .yaml only)."""
    try:
        entries = sorted(directory.iterdir())
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise SpecWriteError(f"cannot list CDI directory {directory}: {_reason(exc)}") from exc
    return [p for p in entries if p.suffix in SPEC_SUFFIXES and not p.is_dir()]


class SpecWriter:
    """The agent's hand in one CDI directory, limited to the files of its own kinds."""

    def __init__(self, directory: Path, kinds: Iterable[str], *, transient_kinds: Iterable[str] = ()) -> None:
        """``kinds`` own their regular file (``<vendor>-<class>.json``); ``transient_kinds``
        also own ``<vendor>-<class>_<id>.json`` files, but only those whose content declares that
        kind: another vendor's kind ``<class>_x`` maps to the same file-name prefix."""
        self.directory = directory
        self._exact = {spec_file_name(k) for k in kinds}
        self._transient = {transient_prefix(k): k for k in transient_kinds}
        #: file name -> (identity of the file read, the qualified names it defines); a claim
        #: batch would otherwise parse every spec in the directory once per claim
        self._names: dict[str, tuple[tuple[int, int, int, int], frozenset[str]]] = {}
        #: file name -> what this writer's last write or removal of it left there
        self._left: dict[str, Left] = {}

    def owns(self, name: str) -> bool:
        """Whether the file name is one the agent writes (the content is not looked at)."""
        if name in self._exact:
            return True
        return name.endswith(SPEC_SUFFIX) and name.startswith(tuple(self._transient)) and "/" not in name

    def render(self, name: str, spec: cdi_spec.Spec) -> bytes:
        """The bytes written for ``spec`` at ``name``: claim specs (transient, written on every
        prepare) as compact JSON, the device plugin's indented for people reading it."""
        return cdi_spec.dumps(spec, compact=self._is_transient(name)).encode()

    def _is_transient(self, name: str) -> bool:
        return name not in self._exact and name.startswith(tuple(self._transient))

    def _declares_our_kind(self, name: str) -> bool:
        """A transient file counts as ours only if it parses and names the kind of its prefix."""
        if name in self._exact:
            return True
        kind = next(k for prefix, k in self._transient.items() if name.startswith(prefix))
        try:
            doc = json.loads((self.directory / name).read_bytes())
        except (OSError, ValueError):
            return False
        return isinstance(doc, dict) and doc.get("kind") == kind

    def _path(self, name: str) -> Path:
        if not self.owns(name):
            raise SpecWriteError(f"refusing to touch {self.directory / name}: not a file this agent owns")
        return self.directory / name

    def owned_files(self) -> list[str]:
        """Names of the files in the directory that belong to the agent (by name, and for
        transient files by declared kind too: these are the files the reconciler may delete)."""
        return [
            p.name
            for p in spec_files(self.directory)
            if self.owns(p.name) and not p.is_symlink() and self._declares_our_kind(p.name)
        ]

    def read(self, name: str) -> bytes | None:
        """The current content, None if absent; SpecWriteError for a symlink or non-file."""
        path = self._path(name)
        if not check_target(path):
            return None
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SpecWriteError(f"cannot read {path}: {_reason(exc)}") from exc

    def write(
        self,
        name: str,
        spec: cdi_spec.Spec,
        *,
        durable: bool = True,
        others: dict[str, frozenset[str]] | None = None,
    ) -> bool:
        """Put ``spec`` at ``name``; False when the file already held exactly this. Validates first.

        ``durable=False``: atomic, but neither the file nor the directory is fsynced.
        ``others``: what :meth:`defined_names` answered for this batch of writes (the directory
        is then listed once per batch, not once per file); this write is added to it.
        """
        path = self._path(name)
        cdi_spec.check(spec)
        data = self.render(name, spec)
        ensure_directory(self.directory)
        if self.read(name) == data:
            return False
        ours = frozenset(spec.qualified_names())
        self._check_conflicts(name, ours, self.defined_names() if others is None else others)
        # remembered first: the watch may report the name before this thread runs on
        self._remember(name, _fingerprint(data))
        try:
            atomic_write(path, data, durable=durable)
        except SpecWriteError:
            self._left.pop(name, None)
            raise
        if others is not None:
            others[name] = ours
        return True

    def remove(self, name: str, *, durable: bool = True) -> bool:
        """Delete an owned file; False when it was already gone (idempotent).

        ``durable=False``: the directory is not fsynced (a power loss may bring the file back).
        """
        path = self._path(name)
        if not check_target(path):
            return False
        self._remember(name, None)  # before the unlink, for the same reason as in write
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._left.pop(name, None)
            raise SpecWriteError(f"cannot remove {path}: {_reason(exc)}") from exc
        if durable:
            fsync_directory(self.directory)
        return True

    def _remember(self, name: str, left: Left) -> None:
        if len(self._left) >= MAX_REMEMBERED and name not in self._left:
            self._left.clear()
        self._left[name] = left

    def left_as_is(self, name: str) -> bool:
        """Whether ``name`` holds exactly what this writer's last write left there (or is still
        gone after its removal): a watch report of it is then that write's own echo. False for a
        file it never touched, a symlink or non-file there, and a file it cannot read. A
        removal's memory is dropped once its echo came (claim names come and go; the memory of
        files that exist is bounded by them). Reads at most one file's worth (a small spec)."""
        if name not in self._left:
            return False
        left = self._left[name]
        try:
            fd = os.open(self.directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            if left is None:
                self._left.pop(name, None)
                return True
            return False
        except OSError:
            return False
        try:
            if left is None or not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            data = os.read(fd, left[0] + 1)
        except OSError:
            return False
        finally:
            os.close(fd)
        return _fingerprint(data) == left

    def remove_stale_temp_files(self) -> list[str]:
        """Temp files of writes that crashed midway (ours only); returns what was removed."""
        removed: list[str] = []
        try:
            entries = list(self.directory.iterdir())
        except OSError:
            return removed
        for entry in entries:
            target = temp_target(entry.name)
            if target is not None and self.owns(target) and not entry.is_symlink():
                with contextlib.suppress(OSError):
                    entry.unlink()
                    removed.append(entry.name)
        return removed

    def _defined_names(self, path: Path) -> frozenset[str]:
        """The qualified names a spec file defines (none when it does not parse), cached per file
        identity (inode, size, mtime, ctime): a file replaced or edited is read again."""
        try:
            st = path.stat()
        except OSError:
            return frozenset()
        identity = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        cached = self._names.get(path.name)
        if cached is not None and cached[0] == identity:
            return cached[1]
        try:
            names = frozenset(read_spec_file(path).qualified_names())
        except InvalidSpecError:
            names = frozenset()  # the runtime skips an unparseable file too
        self._names[path.name] = (identity, names)
        return names

    def defined_names(self) -> dict[str, frozenset[str]]:
        """File name -> the qualified names it defines, for every spec file in the directory."""
        files = spec_files(self.directory)
        present = {p.name for p in files}
        for gone in [n for n in self._names if n not in present]:
            del self._names[gone]
        return {path.name: self._defined_names(path) for path in files}

    def _check_conflicts(self, name: str, ours: frozenset[str], others: Mapping[str, frozenset[str]]) -> None:
        for other, theirs in others.items():
            if other == name:
                continue
            clash = sorted(ours & theirs)
            if clash:
                more = f" and {len(clash) - 3} more" if len(clash) > 3 else ""
                raise SpecConflictError(
                    f"cannot write {self.directory / name}: {self.directory / other} already defines "
                    f"{', '.join(clash[:3])}{more}; the runtime would drop both (remove or rename that file)"
                )
