"""The one atomic-write sequence (agent/base/atomicfile.py): order of the durable steps, failures, modes."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from agent.base.atomicfile import replace_file, temp_target
from tests.disk_ops import record_disk_ops


def test_data_is_fsynced_before_the_rename_and_the_rename_before_the_directory_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ops = record_disk_ops(monkeypatch, tmp_path)
    replace_file(tmp_path / "a.json", b"new", mode=0o644)
    assert ops == [("write", "a.json"), ("fsync-file", "a.json"), ("rename", "a.json"), ("fsync-dir", tmp_path.name)]
    assert (tmp_path / "a.json").read_bytes() == b"new"


def test_a_write_that_need_not_be_durable_is_atomic_without_any_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ops = record_disk_ops(monkeypatch, tmp_path)
    replace_file(tmp_path / "a.json", b"new", mode=0o644, durable=False)
    assert ops == [("write", "a.json"), ("rename", "a.json")]
    assert (tmp_path / "a.json").read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["a.json"]


@pytest.mark.parametrize("failing", ["write", "fsync", "rename"])
def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    target = tmp_path / "a.json"
    target.write_bytes(b"old")

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, failing, broken)
    with pytest.raises(OSError, match="No space left"):
        replace_file(target, b"new", mode=0o644)
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["a.json"]


def test_the_mode_is_exact_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        replace_file(tmp_path / "a.json", b"x", mode=0o644)
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize(
    ("name", "target"),
    [(".a.json.tmp-0123abcd", "a.json"), ("a.json", None), ("a.json.tmp-1", None), (".a.json", None)],
)
def test_temp_files_name_their_target(name: str, target: str | None) -> None:
    assert temp_target(name) == target
