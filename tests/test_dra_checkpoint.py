"""The prepared-claims checkpoint: format, atomic writes, and every way a file can be unusable."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from agent.base.slotfile import SUFFIX as SLOTS_SUFFIX
from agent.dra.claims.checkpoint import (
    FILE_NAME,
    CheckpointError,
    CheckpointStore,
    PreparedClaim,
    PreparedDevice,
    decode,
    encode,
    read_boot_id,
)
from tests.checkpoint_files import put_content
from tests.disk_ops import record_disk_ops

NOW = "2026-12-01T10:00:00.000Z"
SLOTS = FILE_NAME + SLOTS_SUFFIX


def claim(uid: str = "u1", **changes: object) -> PreparedClaim:
    device = PreparedDevice(
        pool="node-a",
        name="gpu-0",
        uuid="GPU-0",
        gpu_uuid="GPU-0",
        requests=("gpu",),
        share_id=None,
        cdi_ids=("k/claim=u1-GPU-0",),
        env={"A": "1"},
    )
    base = PreparedClaim(namespace="ns", name="c", uid=uid, devices=(device,), prepared_at=NOW)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path, now=lambda: NOW)


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    s = store(tmp_path)
    shared = PreparedDevice("node-a", "gpu-1-mig-1-0", "MIG-1", "GPU-1", ("a",), "s1", ("k/claim=x",), {}, True)
    claims = [claim("u1"), claim("u2", devices=(shared,), complete=False)]
    assert s.write(claims, boot_id="boot-a") == NOW
    loaded = s.load()
    assert loaded.status == "ok" and loaded.boot_id == "boot-a" and loaded.written_at == NOW
    assert loaded.claims == {"u1": claims[0], "u2": claims[1]}
    assert loaded.claims["u2"].devices[0].is_mig
    assert sorted(os.listdir(tmp_path)) == [FILE_NAME, SLOTS]  # no temp file left
    assert os.stat(tmp_path / FILE_NAME).st_mode & 0o777 == 0o600
    assert os.stat(tmp_path / SLOTS).st_mode & 0o777 == 0o600


def test_missing_is_a_fresh_start(tmp_path: Path) -> None:
    assert store(tmp_path / "absent").load().status == "missing"


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda raw: raw[: len(raw) // 2], "not JSON"),
        (lambda raw: b"", "not JSON"),
        (lambda raw: raw.replace(b'"gpu-0"', b'"gpu-9"'), "checksum mismatch"),
        (lambda raw: raw.replace(b'"version":2', b'"version":3'), "written by a newer agent (version 3"),
        (lambda raw: b'{"kind": "Something", "version": 1}', "not a checkpoint of this agent"),
        (lambda raw: b"\xff\xfe\x00", "not JSON"),
    ],
    ids=["truncated", "empty", "edited", "newer-version", "foreign", "binary"],
)
def test_an_unusable_file_is_moved_aside_never_raised(tmp_path: Path, damage: object, problem: str) -> None:
    s = store(tmp_path)
    s.write([claim()], boot_id="b")
    raw = (tmp_path / FILE_NAME).read_bytes()
    put_content(tmp_path / FILE_NAME, damage(raw))  # type: ignore[operator]
    loaded = s.load()
    assert loaded.status == "corrupt" and problem in loaded.problem
    assert loaded.moved_to is not None and loaded.moved_to.name == f"{FILE_NAME}.corrupt-20261201T100000000Z"
    assert loaded.moved_to.read_bytes() == damage(raw)  # type: ignore[operator]
    assert (tmp_path / f"{FILE_NAME}.corrupt-20261201T100000000Z{SLOTS_SUFFIX}").exists()  # its record too
    assert not (tmp_path / FILE_NAME).exists() and not (tmp_path / SLOTS).exists() and loaded.claims == {}
    again = s.load()  # twice in a row (a crash loop would look like this): a second move, no error
    assert again.status == "missing"


def test_schema_errors_are_corruption_even_with_a_valid_checksum(tmp_path: Path) -> None:
    raw = json.loads(encode([claim()], boot_id="b", written_at=NOW))
    raw["data"]["claims"][0]["devices"][0]["surprise"] = 1
    from agent.dra.claims.checkpoint import _checksum

    raw["checksum"] = _checksum(raw["data"])
    (tmp_path / FILE_NAME).write_text(json.dumps(raw))
    loaded = store(tmp_path).load()
    assert loaded.status == "corrupt" and "unknown field 'surprise'" in loaded.problem


def test_a_claim_listed_twice_is_corruption() -> None:
    raw = json.loads(encode([claim()], boot_id="b", written_at=NOW))
    raw["data"]["claims"].append(raw["data"]["claims"][0])
    from agent.dra.claims.checkpoint import _checksum, _Unusable

    raw["checksum"] = _checksum(raw["data"])
    with pytest.raises(_Unusable, match="listed twice"):
        decode(json.dumps(raw).encode())


def test_two_corrupt_files_in_the_same_millisecond_both_survive(tmp_path: Path) -> None:
    s = store(tmp_path)
    for _ in range(2):
        (tmp_path / FILE_NAME).write_text("{")
        assert s.load().status == "corrupt"
    assert len(list(tmp_path.glob(f"{FILE_NAME}.corrupt-*"))) == 2


class _Crash(BaseException):
    """The process dies: no cleanup runs."""


def test_a_write_torn_by_a_crash_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """A power loss in the middle of the in-place write: that slot's record no longer checks."""
    s = store(tmp_path)
    s.write([claim("old")], boot_id="b")
    s.write([claim("new")], boot_id="b")  # into the second slot
    slots = (tmp_path / SLOTS).read_bytes()
    half = len(slots) // 2
    torn = slots[:half] + slots[half : half + 200] + b"\0" * 50 + slots[half + 250 :]
    (tmp_path / SLOTS).write_bytes(torn)
    (tmp_path / FILE_NAME).unlink()  # the copy was not replaced either
    loaded = store(tmp_path).load()
    assert loaded.status == "ok" and set(loaded.claims) == {"old"}
    assert json.loads((tmp_path / FILE_NAME).read_bytes())["data"]["claims"][0]["uid"] == "old"  # copy again


def test_a_crash_after_the_record_is_synced_keeps_the_write_and_its_temp_file_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = store(tmp_path)
    s.write([claim("old")], boot_id="b")

    def crash(*args: object, **kwargs: object) -> None:
        raise _Crash

    monkeypatch.setattr(os, "rename", crash)  # the copy's rename, after the slot's fdatasync
    with pytest.raises(_Crash):
        s.write([claim("new")], boot_id="b")
    monkeypatch.undo()
    (tmp,) = (p for p in tmp_path.iterdir() if p.name not in (FILE_NAME, SLOTS))
    assert tmp.name.startswith(".")
    loaded = store(tmp_path).load()
    assert set(loaded.claims) == {"new"} and not tmp.exists()
    assert json.loads((tmp_path / FILE_NAME).read_bytes())["data"]["claims"][0]["uid"] == "new"


def test_a_write_is_durable_before_it_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first write makes the slots file (fsync, rename, fsync of the directory); every later
    one costs one fdatasync of a slot rewritten in place; the copy follows, unsynced."""
    s = store(tmp_path / "state")
    ops = record_disk_ops(monkeypatch, tmp_path)
    s.write([claim()], boot_id="b")
    assert ops == [
        ("write", SLOTS),
        ("fsync-file", SLOTS),
        ("rename", SLOTS),
        ("fsync-dir", "state"),
        ("write", FILE_NAME),
        ("rename", FILE_NAME),
    ]
    ops.clear()
    s.write([claim("u2")], boot_id="b")
    assert ops == [("write", SLOTS), ("fdatasync", SLOTS), ("write", FILE_NAME), ("rename", FILE_NAME)]


def test_an_agent_without_slots_that_wrote_later_is_believed(tmp_path: Path) -> None:
    """A downgrade and back: the older agent wrote only checkpoint.json, after our last record."""
    s = store(tmp_path)
    s.write([claim("ours")], boot_id="b")
    older = encode([claim("theirs")], boot_id="b", written_at=NOW)
    (tmp_path / FILE_NAME).write_bytes(older)
    later = os.stat(tmp_path / SLOTS).st_mtime_ns + 5_000_000_000
    os.utime(tmp_path / FILE_NAME, ns=(later, later))
    assert set(store(tmp_path).load().claims) == {"theirs"}


def test_a_write_that_cannot_happen_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    s = CheckpointStore(tmp_path / "file" / "dir")
    with pytest.raises(CheckpointError, match="cannot create"):
        s.write([claim()], boot_id="b")


def test_a_directory_at_the_path_is_moved_aside(tmp_path: Path) -> None:
    (tmp_path / FILE_NAME).mkdir()
    loaded = store(tmp_path).load()
    assert loaded.status == "corrupt" and "not a regular file" in loaded.problem


def test_boot_id(tmp_path: Path) -> None:
    (tmp_path / "boot_id").write_text("0e1f\n")
    assert read_boot_id(tmp_path / "boot_id") == "0e1f"
    assert read_boot_id(tmp_path / "none") == ""


def test_a_version_1_checkpoint_still_loads(tmp_path: Path) -> None:
    """Written by an agent before partitions: no instances, devices without the new fields."""

    device = {
        "pool": "node-a",
        "device": "gpu-0",
        "uuid": "GPU-0",
        "gpuUUID": "GPU-0",
        "requests": ["gpu"],
        "shareID": None,
        "cdiDeviceIDs": ["k/claim=u1-GPU-0"],
        "env": {},
        "adminAccess": False,
    }
    claim_v1 = {"namespace": "ns", "name": "c", "uid": "u1", "preparedAt": NOW, "complete": True, "devices": [device]}
    data = {"bootID": "b", "writtenAt": NOW, "claims": [claim_v1]}
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    document = {
        "kind": "GpuNodeAgentDraCheckpoint",
        "version": 1,
        "checksum": "sha256:" + hashlib.sha256(canonical).hexdigest(),
        "data": data,
    }
    (tmp_path / FILE_NAME).write_text(json.dumps(document))
    loaded = store(tmp_path).load()
    assert loaded.status == "ok" and loaded.instances == ()
    (device_loaded,) = loaded.claims["u1"].devices
    assert device_loaded.placement is None and device_loaded.share_memory is None and not device_loaded.mps


def test_instances_and_partition_fields_round_trip(tmp_path: Path) -> None:
    from agent.core.inventory.model import MigPlacement
    from agent.dra.claims.checkpoint import CreatedInstance

    part = dataclasses.replace(
        claim().devices[0], name="gpu-0-mig-1g10gb-19-2", uuid="MIG-1", placement=MigPlacement(2, 1), profile_id=19
    )
    share = dataclasses.replace(
        claim().devices[0], share_id="s", share_memory=8 << 30, mps=True, mounts=(("/a", "/b"),)
    )
    made = CreatedInstance("GPU-0", 19, MigPlacement(2, 1), "u1", "MIG-1", 3, 0)
    making = CreatedInstance("GPU-0", 9, MigPlacement(4, 4), "u2")
    s = store(tmp_path)
    s.write([claim("u1", devices=(part, share))], boot_id="b", instances=[made, making])
    loaded = s.load()
    assert loaded.claims["u1"].devices == (part, share) and set(loaded.instances) == {made, making}


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda i: i.update(placement={"start": -1, "size": 1}), "negative"),
        (lambda i: i.update(placement={"start": 0, "size": 0}), "not a placement"),
        (lambda i: i.update(placement={"start": 60, "size": 8}), "not a placement"),
        (lambda i: i.update(profileID=True), "wrong type bool"),
        (lambda i: i.update(uuid=None), "set together"),
        (lambda i: i.update(extra=1), "unknown field"),
    ],
)
def test_a_hostile_instance_record_makes_the_file_unusable(tmp_path: Path, change: Any, problem: str) -> None:
    from agent.core.inventory.model import MigPlacement
    from agent.dra.claims.checkpoint import CreatedInstance

    raw = json.loads(
        encode(
            [], boot_id="b", written_at=NOW, instances=[CreatedInstance("G", 19, MigPlacement(0, 1), "u", "M", 1, 0)]
        )
    )
    change(raw["data"]["instances"][0])

    canonical = json.dumps(raw["data"], sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    raw["checksum"] = "sha256:" + hashlib.sha256(canonical).hexdigest()
    with pytest.raises(Exception, match=problem):
        decode(json.dumps(raw).encode())
