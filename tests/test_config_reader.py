"""Files someone else controls: the config file and preset files are read with a type and size check.

A FIFO, a character device, a directory or a huge file at the path must be refused at once with
one line, never block the caller or grow memory. A hung ``open`` would hang the test too, so the
reads run in a thread with a deadline, and a FIFO reader stuck anyway is released afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.backends.preset import load_preset
from agent.base.errors import ConfigError
from agent.core.config.current import ConfigState
from agent.core.config.loader import load_config, read_document
from agent.core.config.reader import MAX_FILE_BYTES, read_file_bounded
from agent.core.config.watcher import ConfigWatcher
from agent.observe.metrics.agent import LoopLagProbe
from tests.agentproc import run_cli

#: a stall of seconds fails; scheduling noise of a loaded CI machine does not
LAG_BOUND_S = 2.0  # the stalls guarded against lasted 3.4 s to 223 s


@contextlib.contextmanager
def fifo_at(path: Path) -> Iterator[Path]:
    os.mkfifo(path)
    try:
        yield path
    finally:
        # a reader stuck in open() (the bug this guards against) is released by a writer
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


async def refused(read: Callable[[], Any], within_s: float = 5.0) -> str:
    """The one-line ConfigError ``read`` raises, in a thread, within ``within_s``."""
    with pytest.raises(ConfigError) as err:
        await asyncio.wait_for(asyncio.to_thread(read), within_s)
    message = str(err.value)
    assert message and "\n" not in message
    return message


async def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    with fifo_at(tmp_path / "config.yaml") as path:
        message = await refused(lambda: read_document(path))
    assert message == f"cannot read config file {path}: it is a FIFO, not a regular file"


async def test_a_symlink_to_a_fifo_is_refused(tmp_path: Path) -> None:
    with fifo_at(tmp_path / "fifo") as fifo:
        link = tmp_path / "config.yaml"
        link.symlink_to(fifo)
        assert "a FIFO" in await refused(lambda: read_document(link))


async def test_a_character_device_is_refused_before_reading() -> None:
    # /dev/zero never ends: reading it grew memory by a GB a second
    message = await refused(lambda: read_file_bounded(Path("/dev/zero"), label="config file /dev/zero"))
    assert message == "cannot read config file /dev/zero: it is a character device, not a regular file"


async def test_a_directory_is_refused(tmp_path: Path) -> None:
    assert "a directory" in await refused(lambda: read_document(tmp_path))


async def test_a_huge_file_is_refused_by_its_size(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    with path.open("wb") as f:
        f.truncate(100 * 1024 * 1024)  # sparse: the size is there, the bytes are never read
    message = await refused(lambda: read_document(path))
    assert message == f"config file {path} is too large: 104857600 bytes, at most {MAX_FILE_BYTES} are read"


def test_the_limit_is_a_configmaps_and_a_file_at_it_is_read(tmp_path: Path) -> None:
    assert MAX_FILE_BYTES == 1024 * 1024
    path = tmp_path / "config.yaml"
    path.write_bytes(b"#" * MAX_FILE_BYTES)
    assert len(read_file_bounded(path, label="x")) == MAX_FILE_BYTES
    path.write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    with pytest.raises(ConfigError, match="too large"):
        read_file_bounded(path, label="x")


def test_a_missing_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "nope.yaml")
    assert str(err.value) == f"cannot read config file {tmp_path / 'nope.yaml'}: No such file or directory"


async def test_preset_files_are_read_the_same_way(tmp_path: Path) -> None:
    with fifo_at(tmp_path / "node.yaml") as path:
        message = await refused(lambda: load_preset(str(path)))
    assert message == f"cannot read preset file {path}: it is a FIFO, not a regular file"
    big = tmp_path / "big.yaml"
    with big.open("wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)
    assert "too large" in await refused(lambda: load_preset(str(big)))


# --- the live watcher -----------------------------------------------------------------------


def _watcher(path: Path) -> ConfigWatcher:
    return ConfigWatcher(path=path, overrides={}, state=ConfigState(load_config(path)))


@contextlib.asynccontextmanager
async def lag_probe() -> Any:
    probe = LoopLagProbe(interval_s=0.01)
    task = asyncio.create_task(probe.run())
    try:
        yield probe
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_watcher_refuses_a_fifo_and_keeps_the_last_good_config(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("ownership: {default: dra}\n")
    watcher = _watcher(path)
    good = watcher._state.loaded.version
    path.unlink()
    with fifo_at(path):
        async with lag_probe() as probe:
            assert not await asyncio.wait_for(watcher.check(), 5)
        assert probe.max_lag_s < LAG_BOUND_S
    assert "a FIFO" in watcher._state.last_error
    assert watcher._state.loaded.version == good


async def test_a_large_config_is_parsed_off_the_loop(tmp_path: Path) -> None:
    """~1 MiB of YAML takes seconds to parse; the loop keeps running meanwhile."""
    path = tmp_path / "config.yaml"
    path.write_text("{}\n")
    watcher = _watcher(path)
    rules = "".join(f"    - match: {{names: [node-{i:05}]}}\n      default: dra\n" for i in range(15_000))
    path.write_text(f"ownership:\n  nodes:\n{rules}")
    assert MAX_FILE_BYTES / 2 < path.stat().st_size < MAX_FILE_BYTES
    async with lag_probe() as probe:
        assert await watcher.check()
    assert len(watcher._state.config.ownership.nodes) == 15_000
    assert probe.max_lag_s < LAG_BOUND_S, f"event loop blocked for {probe.max_lag_s:.2f}s"


def test_an_agent_given_a_fifo_as_config_stops_with_one_line(tmp_path: Path) -> None:
    """At start-up a FIFO used to block the agent before it could even take SIGTERM."""
    with fifo_at(tmp_path / "config.yaml") as path:
        result = run_cli("run", "--simulated", "--config", str(path), "--debug-addr", "127.0.0.1:0", timeout=30)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"gpu-agent: error: cannot read config file {path}: it is a FIFO, not a regular file"
    )
