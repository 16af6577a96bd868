"""Reading a file someone else controls (the config file, a preset file), with a type and size check.

The path may name anything: a FIFO (``open`` would wait for a writer forever), a character
device (``/dev/zero`` never ends), a directory, or a huge file. :func:`read_file_bounded`
opens without blocking, looks at what it opened, and reads a regular file only, at most
``max_bytes`` of it; everything else is a one-line :class:`ConfigError`. Reading a file that
passes costs one ``read`` of at most ``max_bytes``; callers on the event loop parse the bytes
in a worker thread when parsing can take long (YAML).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from agent.base.errors import ConfigError

#: a ConfigMap holds at most 1 MiB of data, so a config (or a preset) beyond that cannot be real
MAX_FILE_BYTES = 1024 * 1024

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_file_bounded(path: Path, *, label: str, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of the regular file at ``path`` (symlinks followed); ConfigError otherwise.

    ``label`` names the file in errors, e.g. ``config file /etc/agent/config.yaml``.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ConfigError(f"cannot read {label}: {exc.strerror or exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"cannot read {label}: it is {_kind(info.st_mode)}, not a regular file")
        if info.st_size > max_bytes:
            raise ConfigError(f"{label} is too large: {info.st_size} bytes, at most {max_bytes} are read")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:  # the file may grow between fstat and read
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise ConfigError(f"{label} is too large: more than {max_bytes} bytes")
        return b"".join(chunks)
    except OSError as exc:
        raise ConfigError(f"cannot read {label}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
