"""Puts content into a checkpoint's files as another agent (or a bug) would leave it; holds no tests.

The checkpoint is ``checkpoint.json.slots`` (two slots, :mod:`agent.base.slotfile`) with
``checkpoint.json`` as a copy. Editing the copy alone changes nothing (the slots are the record),
so a test that damages "the checkpoint" writes the damaged bytes as the newest slot record,
well framed, and as the copy.
"""

from __future__ import annotations

from pathlib import Path

from agent.base.slotfile import SlotFile


def put_content(path: Path, raw: bytes) -> None:
    """``raw`` becomes what loading the checkpoint at ``path`` reads."""
    SlotFile(path, mode=0o600, max_bytes=len(raw) + 1).write(raw)
