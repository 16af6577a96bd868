"""A small file made durable with one ``fdatasync`` per write: two slots rewritten in place.

:func:`agent.base.atomicfile.replace_file` costs two journal commits on a disk (fsync of a new
file, then of its directory after the rename): milliseconds each, and tens of milliseconds on a
busy node. A write here costs one ``fdatasync`` of blocks that already exist, which the file
system can do without a journal commit at all. For the DRA checkpoint, written before every
NodePrepareResources answer, that is most of the answer's time.

Files, for ``path``:

* ``<path>.slots``: two slots of equal capacity. Each write overwrites the slot that does not
  hold the newest record, in place, and syncs it; the file's size does not change, so its
  metadata does not either. A record is a 64-byte header (magic, generation, length, time,
  SHA-256 of generation, length and payload) and the payload. A write torn by a crash leaves a
  slot whose hash does not match: it is ignored, and the other slot, the previous write, is the
  content (that write returned, the torn one never did). When the payload outgrows the
  capacity, the file is made again with twice the room (:func:`replace_file`, both fsyncs; rare).
* ``<path>``: a plain copy of the newest payload for people and tools, replaced atomically after
  each write but not synced. It is the content only when there is no valid slot: the first start
  after an agent version without slots, or a slots file lost. A copy that differs from both slots
  and was modified after the newest slot was written comes from such an agent version too (a
  downgrade and back), and is taken.

Blocking (file I/O); callers run it off the event loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from agent.base.atomicfile import replace_file

SUFFIX = ".slots"
MAGIC = b"GNASLOT1"
#: magic, generation, payload length, written at (ns since the epoch), SHA-256
_HEADER = struct.Struct(">8sQQQ32s")
HEADER_BYTES = _HEADER.size
#: the smallest slot (header included); capacities double from here
MIN_SLOT_BYTES = 16 * 1024


@dataclass(frozen=True, slots=True)
class Record:
    generation: int
    payload: bytes
    written_ns: int


def _digest(generation: int, payload: bytes) -> bytes:
    return hashlib.sha256(struct.pack(">QQ", generation, len(payload)) + payload).digest()


def encode_record(generation: int, payload: bytes, written_ns: int) -> bytes:
    header = _HEADER.pack(MAGIC, generation, len(payload), written_ns, _digest(generation, payload))
    return header + payload


def decode_record(raw: bytes) -> Record | None:
    """The record at the start of ``raw`` (one slot), None when there is none or it is torn."""
    if len(raw) < HEADER_BYTES:
        return None
    magic, generation, length, written_ns, digest = _HEADER.unpack_from(raw)
    payload = raw[HEADER_BYTES : HEADER_BYTES + length]
    if magic != MAGIC or len(payload) != length or _digest(generation, payload) != digest:
        return None
    return Record(generation, payload, written_ns)


def slot_bytes_for(length: int) -> int:
    size = MIN_SLOT_BYTES
    while size < HEADER_BYTES + length:
        size *= 2
    return size


class SlotFile:
    """``path`` and ``path.slots`` (see the module docstring). ``mode``: both files' permissions."""

    def __init__(self, path: Path, *, mode: int, max_bytes: int) -> None:
        self.path = path
        self.slots = path.with_name(path.name + SUFFIX)
        self._mode = mode
        self._max_bytes = max_bytes
        #: the newest record written or read by this object, and its slot (0 or 1)
        self._newest: tuple[Record, int] | None = None
        self._slot_bytes = 0

    # --- reading ---------------------------------------------------------------------------

    def exists(self) -> bool:
        return self.path.exists() or self.path.is_symlink() or self.slots.exists()

    def read(self) -> bytes | None:
        """The content (see the module docstring); None when there is none. Raises OSError, and
        ValueError when the content is larger than ``max_bytes``."""
        records = self._read_slots()
        copy = self._read_copy()
        valid = [(r, i) for i, r in enumerate(records) if r is not None]
        if not valid:
            self._newest = None
            return copy
        record, index = max(valid, key=lambda ri: ri[0].generation)
        self._newest = (record, index)
        if copy is not None and copy not in {r.payload for r, _ in valid} and self._copy_is_newer(record):
            return copy  # written by an agent version that knows no slots, after our last write
        if copy != record.payload:
            self._publish_copy(record.payload)
        return record.payload

    def _read_slots(self) -> list[Record | None]:
        try:
            fd = os.open(self.slots, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            self._slot_bytes = 0
            return []
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{self.slots} is not a regular file")
            size = os.fstat(fd).st_size
            half = size // 2
            if size % 2 or half < HEADER_BYTES or half > HEADER_BYTES + self._max_bytes * 2:
                self._slot_bytes = 0
                return []  # not a slots file this agent made (or cut short): made again on the next write
            self._slot_bytes = half
            return [decode_record(f.read(half)), decode_record(f.read(half))]

    def _read_copy(self) -> bytes | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{self.path} is not a regular file")
            raw = f.read(self._max_bytes + 1)
        if len(raw) > self._max_bytes:
            raise ValueError(f"larger than {self._max_bytes} bytes")
        return raw

    def _copy_is_newer(self, record: Record) -> bool:
        try:
            return self.path.stat().st_mtime_ns > record.written_ns + 1_000_000_000
        except OSError:
            return False

    # --- writing ---------------------------------------------------------------------------

    def write(self, payload: bytes) -> None:
        """Make ``payload`` the content, durably, with one fdatasync (two, with a directory
        fsync, when the slots file is made). Raises OSError; the previous content stays."""
        if len(payload) > self._max_bytes:
            raise ValueError(f"larger than {self._max_bytes} bytes")
        if self._newest is None and self._slot_bytes == 0:
            with contextlib.suppress(OSError, ValueError):
                self.read()  # first write of this object: find the newest record
        generation = self._newest[0].generation + 1 if self._newest is not None else 1
        record = encode_record(generation, payload, time.time_ns())
        if self._slot_bytes < len(record) or self._newest is None:
            self._make_slots(record, generation, payload)
        else:
            index = 1 - self._newest[1]
            fd = os.open(self.slots, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                view = memoryview(record)
                offset = index * self._slot_bytes
                while view:
                    written = os.pwrite(fd, view, offset)
                    view, offset = view[written:], offset + written
                os.fdatasync(fd)
            finally:
                os.close(fd)
            self._newest = (Record(generation, payload, 0), index)
        self._publish_copy(payload)

    def _make_slots(self, record: bytes, generation: int, payload: bytes) -> None:
        size = slot_bytes_for(len(payload))
        slot = record.ljust(size, b"\0")
        replace_file(self.slots, slot + slot, mode=self._mode)
        self._slot_bytes = size
        self._newest = (Record(generation, payload, 0), 0)

    def _publish_copy(self, payload: bytes) -> None:
        with contextlib.suppress(OSError):  # only a copy: the slots are the record
            replace_file(self.path, payload, mode=self._mode, durable=False)

    # --- moving aside --------------------------------------------------------------------------

    def rename(self, target: Path) -> None:
        """Move both files aside (``target`` and ``target.slots``); the next write starts afresh."""
        if self.path.exists() or self.path.is_symlink():
            os.rename(self.path, target)
        if self.slots.exists() or self.slots.is_symlink():
            os.rename(self.slots, target.with_name(target.name + SUFFIX))
        self._newest = None
        self._slot_bytes = 0
