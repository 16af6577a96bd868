"""The MPS supervisor (agent/backends/mps.py) against a fake control daemon (tests/fakes/fake_mps_control.py)
installed as ``nvidia-cuda-mps-control`` in a temporary driver root: what the daemon is told, and
what happens when it dies, hangs or refuses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agent.backends.mps import MpsSupervisor
from agent.backends.mpscontrol import MAX_OUTPUT, PROGRAM, MpsProgram, daemon_dirs
from agent.base.backoff import Backoff
from agent.core.partitioning import PartitionError, PartitionErrorKind
from tests.fakes import fake_mps_control

GPU = "GPU-1b2c3d4e-0000-1111-2222-333344445555"
OTHER = "GPU-99999999-0000-1111-2222-333344445555"
TIMEOUT = 20.0
FAST = Backoff(initial_s=0.02, max_s=0.1, jitter=0.0)


@dataclass
class Node:
    """A driver root with the fake program, a short MPS directory, and the supervisors made on it."""

    root: Path
    base: Path
    supervisors: list[MpsSupervisor] = field(default_factory=list)

    def supervisor(self, **kwargs: Any) -> MpsSupervisor:
        options: dict[str, Any] = {"check_interval_s": 3600.0, "command_timeout_s": 5.0, "start_timeout_s": 10.0}
        supervisor = MpsSupervisor(driver_root=self.root, base_dir=self.base, backoff=FAST, **{**options, **kwargs})
        self.supervisors.append(supervisor)
        return supervisor

    def knobs(self, **values: Any) -> None:
        (self.root / "fake-mps.json").write_text(json.dumps(values))

    def told(self, role: str | None = None) -> list[dict[str, Any]]:
        path = self.root / "fake-mps.log"
        lines = path.read_text().splitlines() if path.exists() else []
        entries = [json.loads(line) for line in lines]
        return [e for e in entries if role is None or e["role"] == role]

    def commands(self) -> list[str]:
        """What the daemons were told, in order (readiness probes left out)."""
        return [e["command"] for e in self.told("command") if e["command"] != "get_default_active_thread_percentage"]

    def daemon_pids(self) -> list[int]:
        return [e["pid"] for e in self.told("daemon")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie is not alive
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return True


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not condition():  # noqa: ASYNC110  (state in other processes: polled)
            await asyncio.sleep(0.02)


def install(root: Path) -> Path:
    """The fake as ``<root>/usr/bin/nvidia-cuda-mps-control``, run by this Python."""
    program = root / "usr" / "bin" / PROGRAM
    program.parent.mkdir(parents=True)
    source = Path(fake_mps_control.__file__).read_text()
    program.write_text(f"#!{sys.executable}\n{source}")
    program.chmod(0o755)
    return root


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    root = install(tmp_path / "driver-root")
    base = Path(tempfile.mkdtemp(prefix="mps-", dir="/tmp"))  # short: the daemon's sockets live here
    made = Node(root=root, base=base)
    try:
        yield made
    finally:
        for supervisor in made.supervisors:
            await supervisor.close()
        for pid in made.daemon_pids():  # only the daemons this test started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


async def refused(coro: Any, kind: PartitionErrorKind, *words: str) -> str:
    with pytest.raises(PartitionError) as info:
        await coro
    message = str(info.value)
    assert info.value.kind is kind and "\n" not in message, message
    assert all(word in message for word in words), message
    return message


# --- starting, telling, stopping --------------------------------------------------------------


async def test_ensure_starts_one_daemon_for_the_gpu_in_its_own_directories(node: Node) -> None:
    supervisor = node.supervisor()
    daemon = await supervisor.ensure(GPU)
    assert daemon == daemon_dirs(node.base, GPU)
    assert daemon.pipe_dir == node.base / "GPU-1b2c3d4e" / "pipe" and (daemon.pipe_dir / "control").exists()
    assert (daemon.log_dir / "control.log").exists()
    (start,) = node.told("start")
    assert start["argv"] == ["-d"]
    assert start["env"] == {
        "CUDA_VISIBLE_DEVICES": GPU,
        "CUDA_MPS_PIPE_DIRECTORY": str(daemon.pipe_dir),
        "CUDA_MPS_LOG_DIRECTORY": str(daemon.log_dir),
    }
    # readiness is asked of the daemon itself
    assert node.told("command")[-1]["command"] == "get_default_active_thread_percentage"
    assert await supervisor.ensure(GPU) == daemon and len(node.told("start")) == 1
    view = supervisor.status()
    assert view["program"] == str(node.root / "usr" / "bin" / PROGRAM)
    assert view["daemons"][GPU]["state"] == "running"  # type: ignore[index]


async def test_limits_are_sent_as_the_daemon_documents_them(node: Node) -> None:
    supervisor = node.supervisor()
    await supervisor.ensure(GPU)
    await supervisor.set_limits(GPU, active_thread_percentage=50, pinned_memory_mib=40960)
    await supervisor.set_limits(GPU, active_thread_percentage=25, pinned_memory_mib=0)  # 0: no memory limit
    assert node.commands() == [
        "set_default_active_thread_percentage 50",
        f"set_default_device_pinned_mem_limit {GPU} 40960M",
        "set_default_active_thread_percentage 25",
    ]
    await refused(
        supervisor.set_limits(OTHER, active_thread_percentage=50, pinned_memory_mib=0), PartitionErrorKind.NOT_FOUND
    )
    await refused(
        supervisor.set_limits(GPU, active_thread_percentage=101, pinned_memory_mib=0), PartitionErrorKind.FAILED
    )
    assert supervisor.status()["daemons"][GPU]["active_thread_percentage"] == 25  # type: ignore[index]


async def test_release_tells_the_daemon_to_quit(node: Node) -> None:
    supervisor = node.supervisor()
    await supervisor.ensure(GPU)
    (pid,) = node.daemon_pids()
    await supervisor.release(GPU)
    assert node.commands() == ["quit"]
    await until(lambda: not alive(pid))
    await supervisor.release(GPU)  # nothing left: fine
    assert supervisor.status()["daemons"] == {}
    await refused(
        supervisor.set_limits(GPU, active_thread_percentage=50, pinned_memory_mib=0), PartitionErrorKind.NOT_FOUND
    )


async def test_one_daemon_per_gpu(node: Node) -> None:
    supervisor = node.supervisor()
    first, second = await asyncio.gather(supervisor.ensure(GPU), supervisor.ensure(OTHER))
    assert first.pipe_dir != second.pipe_dir
    assert sorted(s["env"]["CUDA_VISIBLE_DEVICES"] for s in node.told("start")) == sorted([GPU, OTHER])


async def test_a_running_daemon_is_adopted_by_the_next_agent(node: Node) -> None:
    first = node.supervisor()
    await first.ensure(GPU)
    await first.close()  # the agent goes; its daemons stay for their clients
    second = node.supervisor()
    await second.ensure(GPU)
    assert len(node.told("start")) == 1
    assert second.status()["daemons"][GPU]["adopted"] is True  # type: ignore[index]


# --- supervision ------------------------------------------------------------------------------


async def test_a_daemon_that_dies_is_started_again_with_its_limits(node: Node) -> None:
    supervisor = node.supervisor(check_interval_s=0.05)
    await supervisor.ensure(GPU)
    await supervisor.set_limits(GPU, active_thread_percentage=30, pinned_memory_mib=1024)
    (first,) = node.daemon_pids()
    os.kill(first, signal.SIGKILL)
    await until(lambda: supervisor.status()["daemons"][GPU]["restarts"] == 1)  # type: ignore[index]
    assert len(node.daemon_pids()) == 2 and node.daemon_pids()[1] != first
    assert node.commands() == [
        "set_default_active_thread_percentage 30",
        f"set_default_device_pinned_mem_limit {GPU} 1024M",
        "set_default_active_thread_percentage 30",  # told again: a new daemon forgets
        f"set_default_device_pinned_mem_limit {GPU} 1024M",
    ]
    assert supervisor.status()["daemons"][GPU]["state"] == "running"  # type: ignore[index]


async def test_a_hung_daemon_is_killed_and_replaced(node: Node) -> None:
    supervisor = node.supervisor(check_interval_s=0.05, command_timeout_s=2.0, start_timeout_s=8.0)
    await supervisor.ensure(GPU)
    (first,) = node.daemon_pids()
    node.knobs(commands="hang")
    await until(lambda: len(node.told("start")) >= 2)  # it stopped answering: a new one is started
    node.knobs()
    await until(lambda: supervisor.status()["daemons"][GPU]["restarts"] >= 1)  # type: ignore[index]
    await until(lambda: not alive(first))
    view = supervisor.status()["daemons"][GPU]  # type: ignore[index]
    assert view["state"] == "running" and view["last_error"] is None


async def test_a_daemon_that_will_not_start(node: Node) -> None:
    node.knobs(start="fail")
    supervisor = node.supervisor()
    message = await refused(
        supervisor.ensure(GPU), PartitionErrorKind.FAILED, f"{PROGRAM} -d for {GPU} failed", "exit status 1"
    )
    assert supervisor.status()["last_error"] == message
    assert supervisor.status()["daemons"] == {}


async def test_a_daemon_that_refuses_a_limit(node: Node) -> None:
    supervisor = node.supervisor()
    await supervisor.ensure(GPU)
    node.knobs(refuse=["set_default_device_pinned_mem_limit"])
    await refused(
        supervisor.set_limits(GPU, active_thread_percentage=50, pinned_memory_mib=512),
        PartitionErrorKind.FAILED,
        "refused 'set_default_device_pinned_mem_limit",
    )


async def test_a_daemon_that_never_answers_fails_ensure_in_bounded_time(node: Node) -> None:
    node.knobs(commands="hang")
    supervisor = node.supervisor(command_timeout_s=0.3, start_timeout_s=2.0)
    await refused(supervisor.ensure(GPU), PartitionErrorKind.FAILED, f"for {GPU} did not", "within")
    clients = [e["pid"] for e in node.told("client")]
    assert clients and not any(alive(pid) for pid in clients)  # every client run was ended


async def test_output_is_bounded(node: Node) -> None:
    supervisor = node.supervisor()
    daemon = await supervisor.ensure(GPU)
    node.knobs(big_reply=True)
    program = MpsProgram.find(node.root)
    assert program is not None
    reply = await program.ask(daemon, "get_default_active_thread_percentage")
    assert reply.ok and len(reply.output) == MAX_OUTPUT


# --- what cannot be done ----------------------------------------------------------------------


async def test_no_program_under_the_driver_root(tmp_path: Path) -> None:
    supervisor = MpsSupervisor(driver_root=tmp_path, base_dir=Path("/tmp/none"))
    await refused(supervisor.ensure(GPU), PartitionErrorKind.NOT_SUPPORTED, f"{PROGRAM} not found under {tmp_path}")


@pytest.mark.parametrize("uuid", ["../../etc", "GPU-../../x", "", "GPU-" + "a" * 100])
async def test_only_uuids_name_directories(node: Node, uuid: str) -> None:
    await refused(node.supervisor().ensure(uuid), PartitionErrorKind.NOT_FOUND, "not a GPU or MIG device UUID")


async def test_a_pipe_directory_too_long_for_sockets(node: Node) -> None:
    supervisor = MpsSupervisor(driver_root=node.root, base_dir=Path("/tmp") / ("x" * 80))
    await refused(supervisor.ensure(GPU), PartitionErrorKind.NOT_SUPPORTED, "shorter state directory")


def test_the_nvml_backend_supervises_mps_under_its_state_directory(tmp_path: Path) -> None:
    from agent.backends.nvml.backend import NvmlBackend
    from agent.core.config.schema import HealthConfig
    from tests.fakes.fake_pynvml import h100_node

    backend = NvmlBackend(health=HealthConfig(), nvml=h100_node(), driver_root=tmp_path, mps_dir=tmp_path / "mps")
    assert isinstance(backend.mps, MpsSupervisor) and backend.mps.status()["base_dir"] == str(tmp_path / "mps")
    assert NvmlBackend(health=HealthConfig(), nvml=h100_node()).mps.status()["enabled"] is False
