"""MPS control daemons on simulated GPUs: the :class:`~agent.core.partitioning.MpsControl` of the simulated backend.

Nothing runs: a daemon is a record in memory. Its directories are the real supervisor's
(:func:`~agent.backends.mpscontrol.daemon_dirs`) and are created, so what DRA mounts into a
container on a simulated node (a kind cluster) exists. The answers follow
:class:`~agent.backends.mps.MpsSupervisor`: ``ensure`` is idempotent, limits need a daemon,
``release`` of nothing is fine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from agent.backends.mpscontrol import check_limits, check_uuid, daemon_dirs, make_dirs
from agent.core.partitioning import MpsDaemon, PartitionError, PartitionErrorKind

log = structlog.get_logger("agent.mps")

#: how many devices may have a simulated daemon at once (the real supervisor's bound)
MAX_DAEMONS = 64


@dataclass(slots=True)
class _Daemon:
    info: MpsDaemon
    limits: tuple[int, int] | None = None
    since: float = field(default_factory=time.time)


class SimulatedMps:
    """Simulated daemons for the GPUs (and MIG devices) ``known`` names."""

    def __init__(self, *, base_dir: Path, known: Callable[[str], bool]) -> None:
        self._base = base_dir
        self._known = known
        self._daemons: dict[str, _Daemon] = {}

    async def ensure(self, gpu_uuid: str) -> MpsDaemon:
        daemon = self._daemons.get(gpu_uuid)
        if daemon is not None:
            return daemon.info
        if not self._known(check_uuid(gpu_uuid)):
            raise PartitionError(f"no device {gpu_uuid} on this simulated node", kind=PartitionErrorKind.NOT_FOUND)
        if len(self._daemons) >= MAX_DAEMONS:
            raise PartitionError(f"{MAX_DAEMONS} MPS daemons run already", kind=PartitionErrorKind.FAILED)
        info = daemon_dirs(self._base, gpu_uuid)
        await asyncio.to_thread(make_dirs, info)
        self._daemons.setdefault(gpu_uuid, _Daemon(info=info))
        log.info("simulated MPS daemon started", gpu=gpu_uuid, pipe_dir=str(info.pipe_dir))
        return self._daemons[gpu_uuid].info

    async def set_limits(self, gpu_uuid: str, *, active_thread_percentage: int, pinned_memory_mib: int) -> None:
        check_limits(active_thread_percentage, pinned_memory_mib)
        daemon = self._daemons.get(gpu_uuid)
        if daemon is None:
            raise PartitionError(f"no MPS daemon runs for {gpu_uuid[:80]}", kind=PartitionErrorKind.NOT_FOUND)
        daemon.limits = (active_thread_percentage, pinned_memory_mib)

    async def release(self, gpu_uuid: str) -> None:
        if self._daemons.pop(gpu_uuid, None) is not None:
            log.info("simulated MPS daemon released", gpu=gpu_uuid)

    def status(self) -> dict[str, object]:
        return {
            "enabled": True,
            "simulated": True,
            "base_dir": str(self._base),
            "daemons": {
                uuid: {
                    "state": "running",
                    "pipe_dir": str(d.info.pipe_dir),
                    "log_dir": str(d.info.log_dir),
                    "active_thread_percentage": d.limits[0] if d.limits else None,
                    "pinned_memory_mib": d.limits[1] if d.limits else None,
                    "since": d.since,
                }
                for uuid, d in sorted(self._daemons.items())
            },
        }

    async def close(self) -> None:
        return None
