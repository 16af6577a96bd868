"""Records the durability-relevant system calls of a write; holds no tests.

:func:`record_disk_ops` wraps ``os.write``, ``os.pwrite``, ``os.fsync``, ``os.fdatasync`` and
``os.rename`` for the rest of a test and returns the list they append to, so a test can check the
order a durable write promises: the data written, the file fsynced, the rename, the directory
fsynced. Only calls on paths under ``root`` are recorded; a temp file counts as the file it
replaces.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agent.base.atomicfile import temp_target


def record_disk_ops(monkeypatch: pytest.MonkeyPatch, root: Path) -> list[tuple[str, str]]:
    """(operation, file name) per call: ``write`` (``os.write`` or ``os.pwrite``), ``fsync-file``,
    ``fdatasync``, ``rename``, ``fsync-dir``; consecutive writes of one file count once."""
    ops: list[tuple[str, str]] = []
    real_write, real_fsync, real_rename = os.write, os.fsync, os.rename
    real_pwrite, real_fdatasync = os.pwrite, os.fdatasync

    def note(op: str, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        if not path.is_relative_to(root):
            return
        entry = (op, temp_target(path.name) or path.name)
        if not ops or ops[-1] != entry or op != "write":
            ops.append(entry)

    def fd_path(fd: int) -> str:
        return os.readlink(f"/proc/self/fd/{fd}")

    def write(fd: int, data: bytes) -> int:
        note("write", fd_path(fd))
        return real_write(fd, data)

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        note("write", fd_path(fd))
        return real_pwrite(fd, data, offset)

    def fdatasync(fd: int) -> None:
        note("fdatasync", fd_path(fd))
        real_fdatasync(fd)

    def fsync(fd: int) -> None:
        note("fsync-dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync-file", fd_path(fd))
        real_fsync(fd)

    def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str], **kwargs: int | None) -> None:
        note("rename", dst)
        real_rename(src, dst, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    return ops
