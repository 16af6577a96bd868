"""One supervised MPS control daemon per shared GPU: the real :class:`~agent.core.partitioning.MpsControl`.

:meth:`MpsSupervisor.ensure` starts ``nvidia-cuda-mps-control -d`` for a GPU (with
``CUDA_VISIBLE_DEVICES`` set to its UUID and its own pipe and log directories under
``base_dir``, see :func:`~agent.backends.mpscontrol.daemon_dirs`) and returns once the daemon
answers ``get_default_active_thread_percentage``, the check NVIDIA's device plugin uses
(NVIDIA/k8s-device-plugin ``cmd/mps-control-daemon/mps/daemon.go``, ``AssertHealthy``, tag
v0.20.0). A daemon that already answers in that directory (the agent restarted, the daemon did
not) is adopted rather than started twice.

Each daemon is then watched: every ``check_interval_s`` it is asked again; one that no longer
answers (it died, or hangs past the command timeout) is stopped if a process is left, and
started again with backoff; the limits last set are sent again, because a daemon forgets them
("The set value is lost if a quit command is executed"). ``status()`` shows each daemon's state,
restarts and last error.

Limits are defaults for the daemon's next MPS server (``set_default_active_thread_percentage``,
``set_default_device_pinned_mem_limit``: "this command will only affect the next server"), so
callers set them before a client connects. ``close()`` stops watching but leaves the daemons
running: clients may be using them, and the next agent adopts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from agent.backends.mpscontrol import (
    PID_FILE,
    PROGRAM,
    MpsProgram,
    Reply,
    check_limits,
    check_socket_room,
    check_uuid,
    daemon_dirs,
    make_dirs,
)
from agent.base.backoff import Backoff
from agent.core.partitioning import MpsDaemon, PartitionError, PartitionErrorKind

log = structlog.get_logger("agent.mps")

READY_COMMAND = "get_default_active_thread_percentage"
#: between attempts to start a daemon that stopped answering
RESTART_BACKOFF = Backoff(initial_s=1.0, max_s=60.0)
#: how many GPUs (or MIG devices) may have a daemon at once
MAX_DAEMONS = 64
#: a PID file is a number; more than this is not one
_PID_FILE_BYTES = 32


@dataclass(slots=True)
class _Daemon:
    info: MpsDaemon
    state: str = "starting"  # starting | running | restarting
    limits: tuple[int, int] | None = None  # (active thread percentage, pinned MiB) last set
    restarts: int = 0
    adopted: bool = False
    last_error: str | None = None
    last_reply: str = ""
    since: float = field(default_factory=time.time)
    watcher: asyncio.Task[None] | None = None

    def view(self) -> dict[str, Any]:
        percentage, pinned = self.limits if self.limits is not None else (None, None)
        return {
            "state": self.state,
            "pipe_dir": str(self.info.pipe_dir),
            "log_dir": str(self.info.log_dir),
            "active_thread_percentage": percentage,
            "pinned_memory_mib": pinned,
            "restarts": self.restarts,
            "adopted": self.adopted,
            "since": self.since,
            "last_error": self.last_error,
        }


class MpsSupervisor:
    """MPS control daemons for the GPUs DRA shares, found under the driver root and supervised.

    Calls run on the event loop; every subprocess is bounded by ``command_timeout_s`` and the
    wait for a new daemon to answer by ``start_timeout_s``. One GPU's calls are serialised.
    """

    def __init__(
        self,
        *,
        driver_root: Path,
        base_dir: Path,
        check_interval_s: float = 10.0,
        command_timeout_s: float = 5.0,
        start_timeout_s: float = 15.0,
        backoff: Backoff = RESTART_BACKOFF,
        proc_root: Path = Path("/proc"),
    ) -> None:
        self._driver_root = driver_root
        self._base = base_dir
        self._interval = check_interval_s
        self._command_timeout = command_timeout_s
        self._start_timeout = start_timeout_s
        self._backoff = backoff
        self._proc = proc_root
        self._program: MpsProgram | None = None
        self._daemons: dict[str, _Daemon] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._last_error: str | None = None
        self._reapers: set[asyncio.Task[None]] = set()

    # --- MpsControl ---------------------------------------------------------------------

    async def ensure(self, gpu_uuid: str) -> MpsDaemon:
        dirs = daemon_dirs(self._base, gpu_uuid)
        check_socket_room(dirs)
        async with self._lock(gpu_uuid):
            known = self._daemons.get(gpu_uuid)
            if known is not None:
                return known.info
            if len(self._daemons) >= MAX_DAEMONS:
                raise PartitionError(f"{MAX_DAEMONS} MPS daemons run already", kind=PartitionErrorKind.FAILED)
            program = await self._find()
            await asyncio.to_thread(make_dirs, dirs)
            daemon = _Daemon(info=dirs)
            if await self._answers(program, daemon):
                daemon.adopted = True
                log.info("MPS daemon adopted", gpu=gpu_uuid, pipe_dir=str(dirs.pipe_dir))
            else:
                await self._fresh(program, daemon)
            daemon.state = "running"
            daemon.watcher = asyncio.create_task(self._watch(program, daemon), name=f"mps-watch-{gpu_uuid[:12]}")
            self._daemons[gpu_uuid] = daemon
            return dirs

    async def set_limits(self, gpu_uuid: str, *, active_thread_percentage: int, pinned_memory_mib: int) -> None:
        """``pinned_memory_mib`` 0 sets no memory limit (the daemon's default)."""
        check_limits(active_thread_percentage, pinned_memory_mib)
        async with self._lock(check_uuid(gpu_uuid)):
            daemon = self._daemons.get(gpu_uuid)
            if daemon is None:
                raise PartitionError(f"no MPS daemon runs for {gpu_uuid}", kind=PartitionErrorKind.NOT_FOUND)
            limits = (active_thread_percentage, pinned_memory_mib)
            await self._apply(await self._find(), daemon, limits)
            daemon.limits = limits

    async def release(self, gpu_uuid: str) -> None:
        async with self._lock(check_uuid(gpu_uuid)):
            daemon = self._daemons.pop(gpu_uuid, None)
            if daemon is None:
                return
            await _cancel(daemon.watcher)
            pid = await asyncio.to_thread(self._pid, daemon)
            program = self._program
            if program is not None:
                try:
                    reply = await self._ask(program, daemon, "quit", quiet=True)
                    if not reply.ok:
                        log.warning("MPS daemon did not take quit", gpu=gpu_uuid, reply=reply.describe())
                except PartitionError as exc:
                    log.warning("MPS daemon did not take quit; stopping its process", gpu=gpu_uuid, error=str(exc))
                    await self._stop_process(daemon)
            self._reap(pid)
            log.info("MPS daemon released", gpu=gpu_uuid)

    def status(self) -> dict[str, object]:
        return {
            "enabled": True,
            "program": str(self._program.path) if self._program is not None else None,
            "base_dir": str(self._base),
            "last_error": self._last_error,
            "daemons": {uuid: d.view() for uuid, d in sorted(self._daemons.items())},
        }

    async def close(self) -> None:
        """Stop watching; the daemons keep running for their clients. Idempotent."""
        for daemon in self._daemons.values():
            await _cancel(daemon.watcher)
            daemon.watcher = None
        for task in list(self._reapers):
            await _cancel(task)

    # --- starting -----------------------------------------------------------------------

    def _lock(self, uuid: str) -> asyncio.Lock:
        return self._locks.setdefault(uuid, asyncio.Lock())

    async def _find(self) -> MpsProgram:
        if self._program is None:
            found = await asyncio.to_thread(MpsProgram.find, self._driver_root, timeout_s=self._command_timeout)
            if found is None:
                self._last_error = f"{PROGRAM} not found under {self._driver_root}"
                raise PartitionError(self._last_error, kind=PartitionErrorKind.NOT_SUPPORTED)
            self._program = found
        return self._program

    async def _ask(self, program: MpsProgram, daemon: _Daemon, command: str, *, quiet: bool = False) -> Reply:
        reply = await program.ask(daemon.info, command)
        daemon.last_reply = reply.output[:200]
        if not quiet:
            log.debug("MPS command", gpu=daemon.info.gpu_uuid, command=command, rc=reply.rc)
        return reply

    async def _start(self, program: MpsProgram, daemon: _Daemon) -> None:
        """Start the daemon and wait until it answers; then send its limits, if any were set."""
        uuid = daemon.info.gpu_uuid
        reply = await program.start(daemon.info, timeout_s=self._start_timeout)
        if not reply.ok:
            failed = f"{PROGRAM} -d for {uuid} failed ({reply.describe()}); see {daemon.info.log_dir}"
            raise self._failed(daemon, failed)
        deadline = time.monotonic() + self._start_timeout
        pause = 0.02
        while True:
            try:
                answer = await self._ask(program, daemon, READY_COMMAND, quiet=True)
            except PartitionError as exc:
                answer = Reply(rc=-1, output=str(exc))
            if answer.ok:
                break
            if time.monotonic() + pause > deadline:
                silent = f"the MPS daemon for {uuid} did not answer within {self._start_timeout:g} s"
                raise self._failed(daemon, f"{silent} ({answer.describe()})")
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.5)
        log.info("MPS daemon started", gpu=uuid, pipe_dir=str(daemon.info.pipe_dir))
        if daemon.limits is not None:
            await self._apply(program, daemon, daemon.limits)

    async def _apply(self, program: MpsProgram, daemon: _Daemon, limits: tuple[int, int]) -> None:
        percentage, pinned = limits
        commands = [f"set_default_active_thread_percentage {percentage}"]
        if pinned:
            commands.append(f"set_default_device_pinned_mem_limit {daemon.info.gpu_uuid} {pinned}M")
        for command in commands:
            reply = await self._ask(program, daemon, command)
            if not reply.ok:
                refused = f"the MPS daemon for {daemon.info.gpu_uuid} refused {command!r}"
                raise self._failed(daemon, f"{refused}: {reply.describe()}")

    def _failed(self, daemon: _Daemon, message: str) -> PartitionError:
        daemon.last_error = self._last_error = message
        return PartitionError(message, kind=PartitionErrorKind.FAILED)

    # --- supervising --------------------------------------------------------------------

    async def _fresh(self, program: MpsProgram, daemon: _Daemon) -> None:
        """Start the daemon, ending first what is left of one that does not answer, and after a failed start."""
        self._reap(await self._stop_process(daemon))
        try:
            await self._start(program, daemon)
        except PartitionError:
            self._reap(await self._stop_process(daemon))
            raise

    async def _watch(self, program: MpsProgram, daemon: _Daemon) -> None:
        """Until cancelled: ask the daemon every interval; restart it, with backoff, when it stops answering.

        The GPU's lock is held for each probe and each start, never across a wait, so a release
        (which cancels this task) is never held up by a daemon that keeps failing.
        """
        uuid = daemon.info.gpu_uuid
        while True:
            await asyncio.sleep(self._interval)
            async with self._lock(uuid):
                if await self._answers(program, daemon):
                    continue
                daemon.state = "restarting"
                log.warning("MPS daemon stopped answering; restarting it", gpu=uuid, error=daemon.last_error)
            await self._restart(program, daemon)

    async def _answers(self, program: MpsProgram, daemon: _Daemon) -> bool:
        try:
            reply = await self._ask(program, daemon, READY_COMMAND, quiet=True)
        except PartitionError as exc:
            daemon.last_error = str(exc)
            return False
        if not reply.ok:
            daemon.last_error = f"the MPS daemon for {daemon.info.gpu_uuid} did not answer: {reply.describe()}"
        return reply.ok

    async def _restart(self, program: MpsProgram, daemon: _Daemon) -> None:
        attempt = 0
        while True:
            attempt += 1
            async with self._lock(daemon.info.gpu_uuid):
                try:
                    await self._fresh(program, daemon)
                except PartitionError as exc:
                    error = str(exc)
                else:
                    daemon.restarts += 1
                    daemon.state = "running"
                    daemon.since = time.time()
                    daemon.last_error = None
                    return
            delay = self._backoff.delay(attempt)
            log.warning("MPS daemon restart failed", gpu=daemon.info.gpu_uuid, error=error, retry_in_s=delay)
            await asyncio.sleep(delay)

    # --- processes left behind ---------------------------------------------------------

    def _pid(self, daemon: _Daemon) -> int | None:
        """The daemon's PID from its PID file, when that process is still an MPS control daemon."""
        try:
            with (daemon.info.pipe_dir / PID_FILE).open("rb") as file:
                text = file.read(_PID_FILE_BYTES)
            pid = int(text.strip())
            cmdline = (self._proc / str(pid) / "cmdline").read_bytes()[:4096]
        except (OSError, ValueError):
            return None
        return pid if pid > 1 and PROGRAM.encode() in cmdline else None

    async def _stop_process(self, daemon: _Daemon) -> int | None:
        """Kill a daemon process that no longer answers (it would hold the pipe directory); its PID."""
        pid = await asyncio.to_thread(self._pid, daemon)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            log.warning("MPS daemon process killed", gpu=daemon.info.gpu_uuid, pid=pid)
        return pid

    def _reap(self, pid: int | None) -> None:
        """Collect the exit of daemon ``pid`` if it was handed to us: ``-d`` leaves the daemon to
        PID 1, which in the agent's container is the agent. Anyone else's child is left alone."""
        if pid is not None:
            task = asyncio.create_task(_reap(pid), name=f"mps-reap-{pid}")
            self._reapers.add(task)
            task.add_done_callback(self._reapers.discard)


async def _reap(pid: int, *, tries: int = 50, pause_s: float = 0.1) -> None:
    """``waitpid(pid)`` until it has exited, for at most ``tries`` pauses; nothing if not our child."""
    for _ in range(tries):
        try:
            done, _status = os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222  (WNOHANG: never blocks)
        except ChildProcessError:
            return
        if done:
            return
        await asyncio.sleep(pause_s)


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is None or task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
