"""The one durable-write sequence of the agent's files (CDI specs, the DRA checkpoint).

:func:`replace_file` puts new content at a path so that a reader, or a crash at any moment,
sees either the old file or the new one, never a mix: a hidden temp file in the same
directory, write, fsync the file, rename over the target, fsync the directory. Callers wrap
the ``OSError`` it raises in their own error (with the operation and the path they care about).

``durable=False`` keeps the atomicity and drops both fsyncs: a reader still sees the old file or
the new one, and a crash of the *process* loses nothing (the kernel has the data), but a crash
of the *kernel* (power loss) may leave the old file, no file or an empty one. It is for files
that a durable record elsewhere can rebuild: the claims' CDI specs, which the DRA checkpoint
records (``docs/cdi.md``, "Durability").

All functions block (file I/O): callers run them off the event loop.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

#: what marks a temp file: ``.<target name>.tmp-<random>`` (hidden, and not ``.json``/``.yaml``,
#: so CDI runtimes never read one)
TEMP_MARK = ".tmp-"


def replace_file(path: Path, data: bytes, *, mode: int, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically and (unless ``durable=False``, see the module
    docstring) durably; file permissions ``mode`` exactly.

    On failure raises ``OSError``; the temp file is gone and the old file untouched.
    """
    directory = path.parent
    tmp = directory / f".{path.name}{TEMP_MARK}{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)  # open's mode is filtered by the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_directory(directory)


def temp_target(name: str) -> str | None:
    """The target file name a temp file of :func:`replace_file` was for; None for any other name.

    Temp files outlive a write only when a crash interrupted it; their owners remove them at start.
    """
    base, mark, _ = name.partition(TEMP_MARK)
    if not mark or not base.startswith("."):
        return None
    return base[1:]


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable; best effort (some file systems refuse it)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # the rename is done either way
            os.fsync(fd)
    finally:
        os.close(fd)
