"""DirectoryWatcher: inotify and polling report the same changes, coalesced, missing dirs too."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from agent.fswatch import DirectoryWatcher

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

    async def until(self, *names: str, within_s: float = 3.0) -> None:
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
            await asyncio.wait_for(collector.task, 1.0)  # close ends the iteration


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

    await check(target, use_inotify, [(recreate, {"y"}), (lambda p: (p / "z").write_text(""), {"z"})])


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
            await asyncio.wait_for(pending, 1.0)
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
