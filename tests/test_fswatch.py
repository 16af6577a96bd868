"""DirectoryWatcher: inotify and polling report the same changes, coalesced, missing dirs too."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import shutil
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from agent.base import fswatch
from agent.base.fswatch import RESCAN, DirectoryWatcher

MODES = [pytest.param(True, id="inotify"), pytest.param(False, id="poll")]


class Collector:
    """Consumes a watcher in the background and remembers every name it reported."""

    def __init__(self, watcher: DirectoryWatcher) -> None:
        self.watcher = watcher
        self.batches: list[set[str]] = []
        self.changed = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for names in self.watcher:
            assert names  # never an empty report
            self.batches.append(names)
            self.changed.set()

    @property
    def seen(self) -> set[str]:
        return set().union(*self.batches) if self.batches else set()

    async def until(self, *names: str, within_s: float = 10.0) -> None:
        async with asyncio.timeout(within_s):
            while not set(names) <= self.seen:
                self.changed.clear()
                await self.changed.wait()

    def reset(self) -> None:
        self.batches.clear()


@pytest.fixture(params=MODES)
def use_inotify(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


async def watching(path: Path, use_inotify: bool) -> AsyncIterator[Collector]:
    async with DirectoryWatcher(path, use_inotify=use_inotify, poll_interval=0.02) as watcher:
        assert watcher.mode == ("inotify" if use_inotify else "poll")
        collector = Collector(watcher)
        try:
            yield collector
        finally:
            await watcher.close()
            await asyncio.wait_for(collector.task, 10.0)  # close ends the iteration


Step = Callable[[Path], object]


async def check(path: Path, use_inotify: bool, steps: list[tuple[Step, set[str]]]) -> None:
    async for c in watching(path, use_inotify):
        for action, expected in steps:
            c.reset()
            action(path)
            await c.until(*expected)


async def test_create_write_delete(tmp_path: Path, use_inotify: bool) -> None:
    await check(
        tmp_path,
        use_inotify,
        [
            (lambda p: (p / "a").write_text("1"), {"a"}),
            (lambda p: (p / "a").write_text("22"), {"a"}),
            (lambda p: (p / "a").chmod(0o600), {"a"}),
            (lambda p: (p / "a").unlink(), {"a"}),
        ],
    )


async def test_rename_reports_both_names(tmp_path: Path, use_inotify: bool) -> None:
    (tmp_path / "old").write_text("x")
    await check(tmp_path, use_inotify, [(lambda p: (p / "old").rename(p / "new"), {"old", "new"})])


async def test_unix_socket_created_and_deleted(tmp_path: Path, use_inotify: bool) -> None:
    path = tmp_path / "kubelet.sock"

    def bind(_: Path) -> None:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()

    await check(tmp_path, use_inotify, [(bind, {"kubelet.sock"}), (lambda p: path.unlink(), {"kubelet.sock"})])


async def test_missing_directory_appears_later(tmp_path: Path, use_inotify: bool) -> None:
    target = tmp_path / "a" / "b" / "device-plugins"

    def create(_: Path) -> None:
        target.mkdir(parents=True)
        (target / "kubelet.sock").write_text("")

    await check(
        target,
        use_inotify,
        [(create, {"kubelet.sock"}), (lambda p: (p / "second").write_text(""), {"second"})],
    )


async def test_directory_deleted_and_recreated(tmp_path: Path, use_inotify: bool) -> None:
    target = tmp_path / "dir"
    target.mkdir()
    (target / "x").write_text("")

    def recreate(_: Path) -> None:
        shutil.rmtree(target)
        target.mkdir()
        (target / "y").write_text("")

    # inotify cannot name what went with the directory (here x, deleted first, is named anyway)
    expected = {"y", RESCAN} if use_inotify else {"x", "y"}
    await check(target, use_inotify, [(recreate, expected), (lambda p: (p / "z").write_text(""), {"z"})])


async def test_directory_moved_away_then_recreated(tmp_path: Path, use_inotify: bool) -> None:
    """A move reports no entry events: inotify says RESCAN, polling names what vanished."""
    target = tmp_path / "dir"
    target.mkdir()
    (target / "x").write_text("")
    async for c in watching(target, use_inotify):
        target.rename(tmp_path / "elsewhere")
        await c.until(RESCAN if use_inotify else "x")
        assert RESCAN not in c.seen or use_inotify  # polling's reports are exact
        c.reset()
        target.mkdir()
        (target / "y").write_text("")
        await c.until("y")
        c.reset()
        (tmp_path / "elsewhere" / "gone").write_text("")  # the old directory is not watched
        (target / "z").write_text("")
        await c.until("z")
        assert "gone" not in c.seen


def overflow_event() -> bytes:
    return fswatch._EVENT.pack(-1, fswatch.IN_Q_OVERFLOW, 0, 0)


def drop_next_read(watcher: DirectoryWatcher, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next read loses every queued event to an overflow, as a full kernel queue would."""
    real_read = watcher._read

    def overflowing_read() -> bytes:
        real_read()  # dropped
        monkeypatch.setattr(watcher, "_read", real_read)
        return overflow_event()

    monkeypatch.setattr(watcher, "_read", overflowing_read)


async def test_overflow_reports_rescan_with_the_listing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "keep").write_text("")
    (tmp_path / "victim.sock").write_text("")
    async for c in watching(tmp_path, True):
        drop_next_read(c.watcher, monkeypatch)
        (tmp_path / "victim.sock").unlink()
        await c.until(RESCAN)
        assert c.seen == {RESCAN, "keep"}  # the deleted name is unknown, RESCAN stands for it
        c.reset()
        (tmp_path / "after").write_text("")
        await c.until("after")


async def test_overflow_follows_a_directory_replaced_meanwhile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The overflow swallowed IN_DELETE_SELF: the watcher must still move to the new directory."""
    target = tmp_path / "dir"
    target.mkdir()
    (target / "x").write_text("")
    async for c in watching(target, True):
        drop_next_read(c.watcher, monkeypatch)
        shutil.rmtree(target)
        target.mkdir()
        (target / "y").write_text("")
        await c.until(RESCAN, "y")
        c.reset()
        (target / "z").write_text("")
        await c.until("z")


def inotify_queue_limit() -> int:
    """The kernel's limit as it is (read, never tuned); skips the test where it is unknown."""
    try:
        return int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    except (OSError, ValueError):
        pytest.skip("inotify queue limit unknown")


async def test_real_queue_overflow_reports_rescan(tmp_path: Path) -> None:
    """17,000 events then an unlink, as in the field: the kernel queue overflows for real."""
    limit = inotify_queue_limit()
    if limit > 200_000:
        pytest.skip(f"inotify queue limit {limit} too large to fill quickly")
    a, b, victim = tmp_path / "a", tmp_path / "b", tmp_path / "victim.sock"
    for path in (a, b, victim):
        path.write_text("")
    async for c in watching(tmp_path, True):
        # no await in between: the watcher reads nothing until the queue has overflowed
        for i in range(limit + 1):
            os.utime(a if i % 2 else b)  # alternating, so the kernel cannot merge them
        victim.unlink()
        await c.until(RESCAN, within_s=10.0)
        assert "victim.sock" not in fswatch._listing(tmp_path)
        c.reset()
        (tmp_path / "after").write_text("")
        await c.until("after")


async def test_switch_to_polling_reports_rescan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "dir"
    target.mkdir()
    (target / "x").write_text("")
    async for c in watching(target, True):

        def no_watch(path: Path, mask: int) -> int:
            ctypes.set_errno(errno.ENOSPC)  # watch limit exhausted
            return -1

        monkeypatch.setattr(c.watcher, "_add_watch", no_watch)
        target.rename(tmp_path / "elsewhere")
        await c.until(RESCAN)
        assert c.watcher.mode == "poll"
        c.reset()
        target.mkdir()
        (target / "y").write_text("")
        await c.until("y")
        assert RESCAN not in c.seen


async def test_bursts_are_coalesced(tmp_path: Path) -> None:
    async with DirectoryWatcher(tmp_path, use_inotify=True) as watcher:
        for i in range(200):
            (tmp_path / f"f{i % 5}").write_text(str(i))
        # nobody read in the meantime: one report holds every name once
        names = await asyncio.wait_for(watcher.__anext__(), 2.0)
        while len(names) < 5:
            names |= await asyncio.wait_for(watcher.__anext__(), 2.0)
        assert names == {f"f{i}" for i in range(5)}


async def test_close_is_idempotent_and_ends_iteration(tmp_path: Path, use_inotify: bool) -> None:
    watcher = DirectoryWatcher(tmp_path, use_inotify=use_inotify)
    await watcher.close()  # before start: harmless
    async with watcher:
        pending = asyncio.create_task(watcher.__anext__())
        await asyncio.sleep(0)
        await watcher.close()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(pending, 10.0)
    await watcher.close()


async def test_poll_uses_injected_sleep(tmp_path: Path) -> None:
    ticks: asyncio.Queue[None] = asyncio.Queue()
    released = asyncio.Event()

    async def sleep(_: float) -> None:
        await ticks.put(None)
        await released.wait()
        released.clear()

    watcher = DirectoryWatcher(tmp_path, use_inotify=False, sleep=sleep)
    async with watcher:
        await ticks.get()  # the poller is waiting for its first tick
        (tmp_path / "f").write_text("")
        released.set()
        assert await asyncio.wait_for(watcher.__anext__(), 1.0) == {"f"}


async def test_inotify_fd_is_closed(tmp_path: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))
    async with DirectoryWatcher(tmp_path, use_inotify=True):
        assert len(os.listdir("/proc/self/fd")) == before + 1
    assert len(os.listdir("/proc/self/fd")) == before
