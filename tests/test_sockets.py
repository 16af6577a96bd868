"""What may and may not be removed before listening on a Unix socket path."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.base.errors import StartupError
from agent.grpc.sockets import remove_stale_socket
from tests.test_plugin_fakes import short_tmpdir


async def test_nothing_there() -> None:
    with short_tmpdir() as root:
        assert await remove_stale_socket(root / "s.sock") is False


async def test_a_stale_socket_is_removed() -> None:
    with short_tmpdir() as root:
        path = root / "s.sock"
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))  # bound, never listening: what a crashed run leaves behind
        assert await remove_stale_socket(path) is True
        assert not path.exists()


async def test_a_socket_someone_serves_on_is_left_alone() -> None:
    with short_tmpdir() as root:
        path = root / "nvidia-gpu.sock"
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))
            s.listen()
            with pytest.raises(StartupError, match="another process is serving on it"):
                await remove_stale_socket(path)
            assert path.exists()


@contextlib.contextmanager
def full_backlog(path: Path) -> Iterator[None]:
    """A listener that never accepts, its backlog filled: a connect to it does not complete."""
    clients: list[socket.socket] = []
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        server.listen(0)
        try:
            for _ in range(64):
                client = socket.socket(socket.AF_UNIX)
                client.setblocking(False)
                clients.append(client)
                try:
                    client.connect(str(path))
                except BlockingIOError:
                    break
            else:
                pytest.skip("the kernel accepted 64 connections on a backlog of 0")
            yield
        finally:
            for client in clients:
                client.close()


async def test_a_busy_listener_is_alive_and_the_probe_does_not_block_the_loop() -> None:
    """A listener with a full backlog does not answer at once: it is alive, and waiting on it
    must leave the event loop free (a blocking connect would stall every other task)."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    with short_tmpdir() as root:
        path = root / "busy.sock"
        with full_backlog(path):
            task = asyncio.create_task(ticker())
            try:
                with pytest.raises(StartupError, match="another process is serving on it"):
                    await remove_stale_socket(path, probe_s=0.2)
            finally:
                task.cancel()
            assert path.exists()
    # the ticker ran while the probe was pending: the probe awaited instead of blocking the loop
    # (a blocking connect returns before the ticker task ever gets the loop, leaving 0)
    assert ticks >= 1


@pytest.mark.parametrize("kind", ["file", "dir"])
async def test_non_sockets_are_never_removed(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "s.sock"
    if kind == "file":
        path.write_text("someone's data")
    else:
        path.mkdir()
    with pytest.raises(StartupError, match="is in the way"):
        await remove_stale_socket(path)
    assert path.exists()
