"""agent/base/slotfile.py: one fdatasync per write, and what a crash can leave."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.base.slotfile import HEADER_BYTES, MIN_SLOT_BYTES, SUFFIX, SlotFile, decode_record, encode_record


def slot_file(tmp_path: Path) -> SlotFile:
    return SlotFile(tmp_path / "state.json", mode=0o600, max_bytes=1 << 20)


def test_nothing_there_reads_none(tmp_path: Path) -> None:
    f = slot_file(tmp_path)
    assert not f.exists() and f.read() is None


def test_writes_alternate_slots_and_a_new_object_reads_the_newest(tmp_path: Path) -> None:
    f = slot_file(tmp_path)
    for i in range(5):
        f.write(f"v{i}".encode())
        assert slot_file(tmp_path).read() == f"v{i}".encode()
        assert (tmp_path / "state.json").read_bytes() == f"v{i}".encode()
    assert os.path.getsize(tmp_path / f"state.json{SUFFIX}") == 2 * MIN_SLOT_BYTES  # never grew
    g = slot_file(tmp_path)  # a restarted process carries on with the generations
    g.write(b"v5")
    assert slot_file(tmp_path).read() == b"v5"


def test_a_payload_larger_than_a_slot_makes_the_file_again_with_room(tmp_path: Path) -> None:
    f = slot_file(tmp_path)
    f.write(b"small")
    big = b"x" * (MIN_SLOT_BYTES * 3)
    f.write(big)
    assert slot_file(tmp_path).read() == big
    assert os.path.getsize(tmp_path / f"state.json{SUFFIX}") == 2 * 4 * MIN_SLOT_BYTES
    f.write(b"small again")
    assert slot_file(tmp_path).read() == b"small again"


@pytest.mark.parametrize("cut", [0, 10, HEADER_BYTES, HEADER_BYTES + 3])
def test_a_torn_record_does_not_count(cut: int) -> None:
    record = encode_record(7, b"payload", 123)
    assert decode_record(record) is not None
    torn = record[:cut] + bytes(len(record) - cut) if cut else bytes(len(record))
    assert decode_record(torn) is None
    assert decode_record(record[:-1]) is None


def test_a_damaged_newest_slot_falls_back_to_the_previous_write(tmp_path: Path) -> None:
    f = slot_file(tmp_path)
    f.write(b"first")
    f.write(b"second")
    path = tmp_path / f"state.json{SUFFIX}"
    raw = bytearray(path.read_bytes())
    raw[MIN_SLOT_BYTES + HEADER_BYTES] ^= 0xFF  # the second slot's payload
    path.write_bytes(bytes(raw))
    assert slot_file(tmp_path).read() == b"first"


def test_without_slots_the_copy_is_the_content(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_bytes(b"from an agent without slots")
    f = slot_file(tmp_path)
    assert f.read() == b"from an agent without slots"
    f.write(b"ours")
    assert slot_file(tmp_path).read() == b"ours"


def test_a_stale_copy_is_replaced_on_read(tmp_path: Path) -> None:
    f = slot_file(tmp_path)
    f.write(b"one")
    f.write(b"two")
    (tmp_path / "state.json").write_bytes(b"one")  # a crash before the copy was replaced
    assert slot_file(tmp_path).read() == b"two"
    assert (tmp_path / "state.json").read_bytes() == b"two"


def test_symlinks_are_not_followed(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_bytes(b"x")
    os.symlink(tmp_path / "elsewhere", tmp_path / f"state.json{SUFFIX}")
    with pytest.raises(OSError):
        slot_file(tmp_path).read()


def test_too_large_is_refused(tmp_path: Path) -> None:
    f = SlotFile(tmp_path / "state.json", mode=0o600, max_bytes=10)
    with pytest.raises(ValueError, match="larger than 10 bytes"):
        f.write(b"x" * 11)


def test_rename_moves_both(tmp_path: Path) -> None:
    f = slot_file(tmp_path)
    f.write(b"x")
    f.rename(tmp_path / "aside")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["aside", f"aside{SUFFIX}"]
    assert not f.exists()
