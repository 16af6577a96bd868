"""Small durable-write helpers shared by the writers of the agent's files (CDI specs, the checkpoint)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


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
