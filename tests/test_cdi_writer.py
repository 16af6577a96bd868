"""The atomic writer: modes, ownership, symlinks, conflicts, and failures that damage nothing."""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cdi import spec as s
from agent.cdi import writer as w
from agent.cdi.errors import SpecConflictError, SpecWriteError

GPU_KIND = "k8s.gpu-node-agent.nvidia.com/gpu"
CLAIM_KIND = "k8s.gpu-node-agent.nvidia.com/claim"
OURS = "k8s.gpu-node-agent.nvidia.com-gpu.json"
CLAIM = "k8s.gpu-node-agent.nvidia.com-claim_abc-1.json"


def make_spec(*names: str, kind: str = GPU_KIND, path: str = "/dev/nvidia0") -> s.Spec:
    edits = s.ContainerEdits(device_nodes=(s.DeviceNode(path),))
    return s.Spec.at_minimum_version(kind=kind, devices=tuple(s.Device(n, edits) for n in names or ("gpu0",)))


@pytest.fixture
def writer(tmp_path: Path) -> w.SpecWriter:
    return w.SpecWriter(tmp_path / "cdi", (GPU_KIND, CLAIM_KIND), transient_kinds=(CLAIM_KIND,))


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if ".tmp-" in p.name]


def test_write_creates_dir_0755_and_file_0644(writer: w.SpecWriter) -> None:
    old = os.umask(0o077)
    try:
        assert writer.write(OURS, make_spec()) is True
    finally:
        os.umask(old)
    assert stat.S_IMODE(writer.directory.stat().st_mode) == 0o755
    assert stat.S_IMODE((writer.directory / OURS).stat().st_mode) == 0o644
    assert s.loads((writer.directory / OURS).read_text()) == make_spec()
    assert writer.write(OURS, make_spec()) is False  # same bytes: no write
    assert leftovers(writer.directory) == []


def test_ownership_is_by_file_name(writer: w.SpecWriter) -> None:
    assert writer.owns(OURS) and writer.owns(CLAIM)
    for foreign in (
        "nvidia.yaml",
        "k8s.gpu-node-agent.nvidia.com-gpu.yaml",
        "x-k8s.gpu-node-agent.nvidia.com-gpu.json",
    ):
        assert not writer.owns(foreign)
        with pytest.raises(SpecWriteError, match="not a file this agent owns"):
            writer.write(foreign, make_spec())
        with pytest.raises(SpecWriteError):
            writer.remove(foreign)


def test_owned_files_lists_only_ours(writer: w.SpecWriter) -> None:
    writer.write(OURS, make_spec())
    writer.write(CLAIM, make_spec("abc-1-gpu0", kind=CLAIM_KIND))
    (writer.directory / "vendor.json").write_text("{}")
    assert sorted(writer.owned_files()) == sorted([OURS, CLAIM])


def test_refuses_a_planted_symlink(writer: w.SpecWriter, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    writer.directory.mkdir()
    (writer.directory / OURS).symlink_to(victim)
    with pytest.raises(SpecWriteError, match="symlink"):
        writer.write(OURS, make_spec())
    with pytest.raises(SpecWriteError, match="symlink"):
        writer.remove(OURS)
    assert victim.read_text() == "precious"
    assert (writer.directory / OURS).is_symlink()


def test_refuses_foreign_file_with_the_same_names(writer: w.SpecWriter) -> None:
    writer.directory.mkdir()
    foreign = writer.directory / "someone-else.yaml"
    foreign.write_text(s.dumps(make_spec("gpu0")))
    with pytest.raises(
        SpecConflictError, match=re.escape("someone-else.yaml already defines k8s.gpu-node-agent.nvidia.com/gpu=gpu0")
    ):
        writer.write(OURS, make_spec("gpu0"))
    assert not (writer.directory / OURS).exists()
    writer.write(OURS, make_spec("gpu1"))  # other names are fine
    assert foreign.read_text() == s.dumps(make_spec("gpu0"))


@pytest.mark.parametrize(
    ("failing", "code", "message"), [("write", errno.ENOSPC, "no space left"), ("open", errno.EROFS, "read-only")]
)
def test_failed_write_keeps_the_previous_file(
    writer: w.SpecWriter, monkeypatch: pytest.MonkeyPatch, failing: str, code: int, message: str
) -> None:
    writer.write(OURS, make_spec("gpu0"))
    before = (writer.directory / OURS).read_bytes()
    real = getattr(os, failing)

    def broken(*args: object, **kwargs: object) -> object:
        if failing == "open" and not str(args[0]).startswith(str(writer.directory / ".")):
            return real(*args, **kwargs)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(w.os, failing, broken)
    with pytest.raises(SpecWriteError, match=message):
        writer.write(OURS, make_spec("gpu0", "gpu1"))
    monkeypatch.undo()
    assert (writer.directory / OURS).read_bytes() == before
    assert leftovers(writer.directory) == []


def test_read_only_directory_for_real(writer: w.SpecWriter) -> None:
    writer.write(OURS, make_spec())
    writer.directory.chmod(0o555)
    try:
        if os.access(writer.directory, os.W_OK):
            pytest.skip("root ignores directory permissions")
        with pytest.raises(SpecWriteError, match="Permission denied"):
            writer.write(OURS, make_spec("gpu0", "gpu1"))
    finally:
        writer.directory.chmod(0o755)
    assert s.loads((writer.directory / OURS).read_text()) == make_spec()


def test_remove_is_idempotent_and_stale_temps_are_cleaned(writer: w.SpecWriter) -> None:
    writer.write(CLAIM, make_spec("abc-1-gpu0", kind=CLAIM_KIND))
    stale = writer.directory / f".{CLAIM}.tmp-deadbeef"
    stale.write_text("half")
    foreign_tmp = writer.directory / ".vendor.json.tmp-1"
    foreign_tmp.write_text("theirs")
    assert writer.remove_stale_temp_files() == [stale.name]
    assert foreign_tmp.exists()
    assert writer.remove(CLAIM) is True
    assert writer.remove(CLAIM) is False


def test_invalid_spec_is_never_written(writer: w.SpecWriter) -> None:
    bad = s.Spec(version="0.3.0", kind=GPU_KIND, devices=(s.Device("0", s.ContainerEdits()),))
    with pytest.raises(Exception, match="empty device edits"):
        writer.write(OURS, bad)
    assert not (writer.directory / OURS).exists()


def test_atomic_write_refuses_directory_target(tmp_path: Path) -> None:
    (tmp_path / "x.json").mkdir()
    with pytest.raises(SpecWriteError, match="not a regular file"):
        w.atomic_write(tmp_path / "x.json", b"{}")


REAL_FS_SCRIPT = """
import subprocess, sys
from pathlib import Path
from agent.cdi import spec as s, writer as w
from agent.cdi.errors import SpecWriteError
from tests.test_cdi_writer import CLAIM_KIND, GPU_KIND, OURS, make_spec

d = Path(sys.argv[1])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)], check=True)
writer = w.SpecWriter(d, (GPU_KIND, CLAIM_KIND), transient_kinds=(CLAIM_KIND,))
writer.write(OURS, make_spec("gpu0"))
before = (d / OURS).read_bytes()
with open(d / "filler", "wb", buffering=0) as f:  # fill the file system
    try:
        while True:
            f.write(b"x" * 4096)
    except OSError:
        pass
big = make_spec(*[f"gpu{i}" for i in range(400)])
try:
    writer.write(OURS, big)
    print("full: no error")
except SpecWriteError as exc:
    print("full:", exc)
assert (d / OURS).read_bytes() == before
assert not [p for p in d.iterdir() if ".tmp-" in p.name]
(d / "filler").unlink()
subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
for op in (lambda: writer.write(OURS, big), lambda: writer.remove(OURS)):
    try:
        op()
        print("ro: no error")
    except SpecWriteError as exc:
        print("ro:", exc)
assert (d / OURS).read_bytes() == before
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare for a tmpfs")
def test_full_and_read_only_file_systems_for_real(tmp_path: Path) -> None:
    """A real tmpfs in a private mount namespace: ENOSPC, then EROFS; the old spec survives both."""
    target = tmp_path / "cdi"
    target.mkdir()
    repo = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        ["unshare", "-m", "--propagation", "private", sys.executable, "-c", REAL_FS_SCRIPT, str(target)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("full:") and "no space left on device" in line for line in lines), lines
    read_only = [line for line in lines if line.startswith("ro:")]
    assert len(read_only) == 2 and all("read-only" in line for line in read_only), lines


def test_left_as_is_tells_its_own_writes_from_anyone_elses(writer: w.SpecWriter) -> None:
    """What the service's directory watch asks before it starts a reconcile pass."""
    path = writer.directory / CLAIM
    assert not writer.left_as_is(CLAIM)  # never touched: anything reported is news
    writer.write(CLAIM, make_spec("a", kind=CLAIM_KIND), durable=False)
    assert writer.left_as_is(CLAIM) and writer.left_as_is(CLAIM)  # as often as the watch reports it
    written = path.read_bytes()
    # the same length, the same inode, within the same clock tick: still seen, by content
    path.write_bytes(written.replace(b"nvidia0", b"nvidia9"))
    assert not writer.left_as_is(CLAIM)
    path.write_bytes(written)
    assert writer.left_as_is(CLAIM)  # back to what the agent wrote: nothing to repair
    path.write_bytes(written + b" ")
    assert not writer.left_as_is(CLAIM)
    path.unlink()
    assert not writer.left_as_is(CLAIM)  # deleted by someone
    elsewhere = writer.directory.parent / "elsewhere.json"
    elsewhere.write_bytes(written)
    path.symlink_to(elsewhere)
    assert not writer.left_as_is(CLAIM)  # a symlink is never the agent's, whatever it points at
    path.unlink()
    writer.write(CLAIM, make_spec("a", kind=CLAIM_KIND), durable=False)
    assert writer.remove(CLAIM, durable=False)
    assert writer.left_as_is(CLAIM)  # its removal's echo: once, then forgotten
    assert not writer.left_as_is(CLAIM)
    path.write_bytes(written)
    assert not writer.left_as_is(CLAIM)  # re-created by someone


def test_left_as_is_forgets_a_write_that_failed(writer: w.SpecWriter) -> None:
    writer.write(OURS, make_spec("a"))
    (writer.directory / OURS).unlink()
    (writer.directory / OURS).mkdir()  # the write below is refused: a directory at the target
    with pytest.raises(SpecWriteError):
        writer.write(OURS, make_spec("b"))
    assert not writer.left_as_is(OURS)


def test_left_as_is_remembers_a_bounded_number_of_files(writer: w.SpecWriter, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(w, "MAX_REMEMBERED", 4)
    names = [f"k8s.gpu-node-agent.nvidia.com-claim_u{i}.json" for i in range(5)]
    for name in names:
        writer.write(name, make_spec(name[-7:-5], kind=CLAIM_KIND), durable=False)
    assert writer.left_as_is(names[-1])
    assert not any(writer.left_as_is(n) for n in names[:-1])  # started afresh at the fifth
