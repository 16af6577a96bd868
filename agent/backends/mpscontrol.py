"""Running ``nvidia-cuda-mps-control``: starting one MPS control daemon, and telling it a command.

The program serves both roles (NVIDIA's MPS documentation, "Tools and Interface Reference",
https://docs.nvidia.com/deploy/mps/appendix-tools-and-interface-reference.html):
``nvidia-cuda-mps-control -d`` starts a control daemon in the background, and
``nvidia-cuda-mps-control`` without arguments is its client, writing the command it reads on
stdin (``quit``, ``get_default_active_thread_percentage``, ...) to the daemon that the
environment names. Which daemon, and which GPU it serves, is only environment
(https://docs.nvidia.com/deploy/mps/appendix-environment-variables.html):
``CUDA_MPS_PIPE_DIRECTORY`` (its pipes and sockets; clients need the same one),
``CUDA_MPS_LOG_DIRECTORY`` (``control.log``, ``server.log``) and ``CUDA_VISIBLE_DEVICES``
(the GPU, by UUID, as the MIG user guide's "MIG with CUDA MPS" example does).

Every run is bounded: a time limit after which the process is killed, and at most
:data:`MAX_OUTPUT` bytes of its output kept. Nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from agent.backends.driverroot import find_library, find_utility, in_root, resolve_in_root
from agent.core.partitioning import MpsDaemon, PartitionError, PartitionErrorKind

PROGRAM = "nvidia-cuda-mps-control"
#: the daemon writes its PID here, in its pipe directory
PID_FILE = "nvidia-cuda-mps-control.pid"
#: output kept from one command; the rest is read and dropped
MAX_OUTPUT = 4096
#: the pipe directory holds Unix sockets, whose paths must fit 107 bytes; leave room for their names
MAX_PIPE_DIR = 88
#: a GPU (or MIG device) UUID as NVML writes it, bounded
_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z-]{8,64}$")


def check_uuid(uuid: str) -> str:
    """``uuid`` if it looks like a GPU or MIG UUID (it names directories); PartitionError otherwise."""
    if not _UUID.fullmatch(uuid):
        raise PartitionError(f"not a GPU or MIG device UUID: {uuid[:80]!r}", kind=PartitionErrorKind.NOT_FOUND)
    return uuid


def daemon_dirs(base: Path, uuid: str) -> MpsDaemon:
    """Where the daemon of ``uuid`` keeps its pipes and logs: ``<base>/<GPU-xxxxxxxx>/{pipe,log}``.

    The directory is named by the first 12 characters of the UUID, so that socket paths stay short.
    """
    home = base / check_uuid(uuid)[:12]
    return MpsDaemon(gpu_uuid=uuid, pipe_dir=home / "pipe", log_dir=home / "log")


def check_socket_room(daemon: MpsDaemon) -> None:
    """PartitionError when the pipe directory is too long for the daemon's Unix sockets."""
    if len(os.fsencode(daemon.pipe_dir)) > MAX_PIPE_DIR:
        raise PartitionError(
            f"MPS pipe directory {str(daemon.pipe_dir)[:120]} is longer than {MAX_PIPE_DIR} bytes: the daemon's "
            "sockets would not fit a Unix socket path; give the agent a shorter state directory",
            kind=PartitionErrorKind.NOT_SUPPORTED,
        )


def make_dirs(daemon: MpsDaemon) -> None:
    """Create the daemon's pipe and log directories. Blocking: run it in a thread."""
    try:
        daemon.pipe_dir.mkdir(parents=True, exist_ok=True)
        daemon.log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PartitionError(
            f"cannot create the MPS directories for {daemon.gpu_uuid} under {daemon.pipe_dir.parent}: {exc.strerror}",
            kind=PartitionErrorKind.FAILED,
        ) from exc


def check_limits(active_thread_percentage: int, pinned_memory_mib: int) -> None:
    """PartitionError unless the percentage is 1-100 and the pinned memory (MiB, 0: none) is sane."""
    if not 1 <= active_thread_percentage <= 100:
        raise PartitionError(
            f"active thread percentage must be 1-100, got {active_thread_percentage}", kind=PartitionErrorKind.FAILED
        )
    if not 0 <= pinned_memory_mib < 1 << 40:
        message = f"pinned memory limit out of range: {pinned_memory_mib} MiB"
        raise PartitionError(message, kind=PartitionErrorKind.FAILED)


@dataclass(frozen=True, slots=True)
class Reply:
    """What one run of the program answered: its exit status and (the start of) its output."""

    rc: int
    output: str

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def describe(self) -> str:
        text = " ".join(self.output.split())[:200]
        return f"exit status {self.rc}" + (f": {text}" if text else "")


class MpsProgram:
    """``nvidia-cuda-mps-control`` found under a driver root, and how to run it.

    With a driver root other than ``/`` (a driver container), the program's directory goes first
    on ``PATH`` (the daemon starts ``nvidia-cuda-mps-server`` from there) and the directory
    holding ``libcuda.so.1`` goes on ``LD_LIBRARY_PATH``.
    """

    def __init__(self, path: Path, *, library_dir: Path | None = None, timeout_s: float = 5.0) -> None:
        self.path = path
        self._library_dir = library_dir
        self.timeout_s = timeout_s

    @classmethod
    def find(cls, driver_root: Path, *, timeout_s: float = 5.0) -> MpsProgram | None:
        """The program under ``driver_root``, or None. Blocking: a few stats and the linker cache."""
        found = find_utility(driver_root, PROGRAM)
        if found is None:
            return None
        path = in_root(driver_root, resolve_in_root(driver_root, found) or found)
        library_dir = None
        if driver_root.resolve() != Path("/"):
            libcuda = find_library(driver_root, "libcuda.so.1").found
            library_dir = libcuda.parent if libcuda is not None else None
        return cls(path, library_dir=library_dir, timeout_s=timeout_s)

    def environment(self, daemon: MpsDaemon) -> dict[str, str]:
        """The whole environment of a run: nothing of the agent's own but ``PATH`` and the locale."""
        env = {name: os.environ[name] for name in ("LANG", "LC_ALL") if name in os.environ}
        env["PATH"] = os.pathsep.join([str(self.path.parent), os.environ.get("PATH", "/usr/bin:/bin")])
        if self._library_dir is not None:
            env["LD_LIBRARY_PATH"] = str(self._library_dir)
        env["CUDA_VISIBLE_DEVICES"] = daemon.gpu_uuid
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(daemon.pipe_dir)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(daemon.log_dir)
        return env

    async def start(self, daemon: MpsDaemon, *, timeout_s: float | None = None) -> Reply:
        """``nvidia-cuda-mps-control -d``: returns once the program has put the daemon in the background.

        Its output goes nowhere (the daemon would hold our pipe open for its whole life); the
        daemon writes ``control.log`` in its log directory instead. ``timeout_s`` defaults to the
        command timeout.
        """
        process = await asyncio.create_subprocess_exec(
            str(self.path),
            "-d",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            env=self.environment(daemon),
            start_new_session=True,  # signals to the agent's process group leave the daemon be
        )
        return await self._finish(process, daemon, "-d", output=None, timeout_s=timeout_s)

    async def ask(self, daemon: MpsDaemon, command: str) -> Reply:
        """One command on the client's stdin; its answer. PartitionError when it does not finish in time."""
        process = await asyncio.create_subprocess_exec(
            str(self.path),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=self.environment(daemon),
            start_new_session=True,
        )
        return await self._finish(process, daemon, command, output=command)

    async def _finish(
        self,
        process: asyncio.subprocess.Process,
        daemon: MpsDaemon,
        what: str,
        output: str | None,
        timeout_s: float | None = None,
    ) -> Reply:
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(limit):
                text = ""
                if output is not None:
                    assert process.stdin is not None and process.stdout is not None
                    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                        process.stdin.write(f"{output}\n".encode())
                        await process.stdin.drain()
                        process.stdin.close()
                    text = await _read_bounded(process.stdout)
                rc = await process.wait()
        except TimeoutError:
            raise PartitionError(
                f"{PROGRAM} {what!r} for {daemon.gpu_uuid} did not finish within {limit:g} s",
                kind=PartitionErrorKind.FAILED,
            ) from None
        finally:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        return Reply(rc=rc, output=text)


async def _read_bounded(stream: asyncio.StreamReader) -> str:
    """Everything the stream says until EOF; only the first :data:`MAX_OUTPUT` bytes are kept."""
    kept = bytearray()
    while chunk := await stream.read(65536):
        kept += chunk[: max(0, MAX_OUTPUT - len(kept))]
    return kept.decode("utf-8", "replace")
