"""The durable record of the device plugin's grants: written whole, never trusted when unreadable."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent.core.ownership.record import RECORD_FILE, GrantRecord, RecordKeeper


def test_a_record_is_read_back_as_written(tmp_path: Path) -> None:
    record = GrantRecord(tmp_path)
    assert record.load() == frozenset()  # none yet
    record.write(frozenset({"GPU-b", "GPU-a"}))
    assert record.load() == {"GPU-a", "GPU-b"}
    assert (tmp_path / RECORD_FILE).stat().st_mode & 0o777 == 0o600
    assert not [p for p in tmp_path.iterdir() if p.name != RECORD_FILE]  # no temp file left


@pytest.mark.parametrize(
    "content",
    [b"{", b'{"format": 2, "device_plugin": ["GPU-a"]}', b'{"format": 1, "device_plugin": [1]}', b"x" * (2 << 20)],
)
def test_a_record_this_agent_did_not_write_is_removed_not_trusted(tmp_path: Path, content: bytes) -> None:
    (tmp_path / RECORD_FILE).write_bytes(content)
    on_disk = GrantRecord(tmp_path).load()
    assert on_disk is None
    keeper = RecordKeeper(GrantRecord(tmp_path), on_disk=on_disk, all_gpus=["GPU-a", "GPU-b"])
    assert keeper.maybe_on_disk == {"GPU-a", "GPU-b"}  # unknown content: it may list every GPU
    asyncio.run(keeper.forget_unreadable())
    assert not (tmp_path / RECORD_FILE).exists() and keeper.maybe_on_disk == frozenset()


def test_a_record_that_cannot_be_written_or_removed_keeps_its_gpus_from_dra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = GrantRecord(tmp_path)
    record.write(frozenset({"GPU-a"}))
    keeper = RecordKeeper(record, on_disk=frozenset({"GPU-a"}))

    def read_only(*_: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(record, "write", read_only)
    monkeypatch.setattr(record, "remove", read_only)
    keeper.want(frozenset())
    asyncio.run(keeper.flush())
    assert "Read-only file system" in keeper.last_error and keeper.pending()
    assert keeper.maybe_on_disk == {"GPU-a"}


def test_a_write_that_fails_removes_the_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = GrantRecord(tmp_path)
    record.write(frozenset({"GPU-a"}))
    keeper = RecordKeeper(record, on_disk=frozenset({"GPU-a"}))

    def full(gpus: frozenset[str]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(record, "write", full)
    keeper.want(frozenset({"GPU-b"}))
    assert keeper.maybe_on_disk == {"GPU-a", "GPU-b"}  # either may be on disk while it is written
    asyncio.run(keeper.flush())
    assert "No space left on device" in keeper.last_error
    assert not (tmp_path / RECORD_FILE).exists() and keeper.maybe_on_disk == {"GPU-b"}
