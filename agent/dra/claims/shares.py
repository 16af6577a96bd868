"""Shares of a shared GPU under MPS (``dra.sharing.mps: true``): the daemon, and each share's limits.

Without MPS a share is what the scheduler accounted: its memory is not enforced, and the GPU's
time is sliced by the driver between the processes of every share. With MPS the agent has one
control daemon per shared GPU run (``MpsControl.ensure``, the backend's supervisor) and gives each
share's containers, through its CDI device:

* ``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_MPS_LOG_DIRECTORY``, with the daemon's pipe and log
  directories bind-mounted there, so CUDA in the container talks to the daemon;
* ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<GPU UUID>=<MiB>M``: the memory the scheduler allocated the
  share, which the MPS server enforces on each of the container's processes;
* ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``: the share's part of the GPU's memory, rounded up, as its
  part of the GPU's threads.

Both limits are client settings (NVIDIA's MPS documentation, "Environment Variables"): the
server enforces them, but a process that rewrites its own environment before CUDA starts can
raise them up to the daemon's defaults, which stay at the whole GPU so that shares of different
sizes can share one daemon. They keep honest workloads apart; they are no wall against a hostile
one. A daemon is released when the last share of its GPU is unprepared. A process talks to one
daemon (``CUDA_MPS_PIPE_DIRECTORY``), so a claim with MPS shares of two GPUs is refused.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable
from dataclasses import replace

import structlog

from agent.core.partitioning import MpsControl, MpsDaemon, PartitionError
from agent.dra.claims.errors import ClaimError, Reason
from agent.dra.claims.pending import PendingClaim, ShareSetup
from agent.dra.claims.plan import PlannedDevice

log = structlog.get_logger("agent.dra")

#: where a container sees the daemon's directories (the MPS defaults)
PIPE_PATH = "/tmp/nvidia-mps"
LOG_PATH = "/var/log/nvidia-mps"
#: starting a daemon, or telling it its defaults
CALL_TIMEOUT_S = 20.0


def share_env(gpu_uuid: str, share_memory: int, gpu_memory: int) -> dict[str, str]:
    """The client limits of one share (pure)."""
    percent = min(100, max(1, math.ceil(100 * share_memory / gpu_memory)))
    return {
        "CUDA_MPS_PIPE_DIRECTORY": PIPE_PATH,
        "CUDA_MPS_LOG_DIRECTORY": LOG_PATH,
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{gpu_uuid}={max(1, share_memory >> 20)}M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percent),
    }


class MpsShares:
    def __init__(self, *, mps: MpsControl, call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        self._mps = mps
        self._timeout = call_timeout_s
        #: GPUs whose daemon this process started (or found again after a restart)
        self._running: dict[str, MpsDaemon] = {}
        self.last_error = ""

    async def setup(self, pending: list[PendingClaim]) -> tuple[list[PendingClaim], dict[str, ClaimError]]:
        """The batch's claims with their MPS shares set up; claims whose GPU's daemon failed."""
        failed: dict[str, ClaimError] = {}
        for claim in pending:
            spanned = {p.device.gpu_uuid for p in claim.planned if _mps(p)}
            if len(spanned) > 1:
                # CUDA_MPS_PIPE_DIRECTORY names one daemon: a process reaches the MPS of one GPU only
                failed[claim.ref.uid] = ClaimError(
                    Reason.MPS_ERROR,
                    f"the claim has MPS shares of {len(spanned)} GPUs; a container reaches one GPU's MPS daemon "
                    "(CUDA_MPS_PIPE_DIRECTORY names one): ask for shares of one GPU per claim",
                    recoverable=False,
                )
        pending = [c for c in pending if c.ref.uid not in failed]
        gpus = {
            p.device.gpu_uuid: p.device.share.memory for c in pending for p in c.planned if p.device.share and _mps(p)
        }
        if not gpus:
            return pending, failed
        daemons = dict(zip(gpus, await asyncio.gather(*(self._ensure(g, m) for g, m in gpus.items())), strict=True))
        out: list[PendingClaim] = []
        for claim in pending:
            shares: dict[int, ShareSetup] = {}
            for i, p in enumerate(claim.planned):
                if not _mps(p) or p.share_memory is None or p.device.share is None:
                    continue
                daemon = daemons[p.device.gpu_uuid]
                if isinstance(daemon, ClaimError):
                    failed[claim.ref.uid] = daemon
                    break
                env = share_env(p.device.gpu_uuid, p.share_memory, p.device.share.memory)
                mounts = ((str(daemon.pipe_dir), PIPE_PATH), (str(daemon.log_dir), LOG_PATH))
                shares[i] = ShareSetup(env=env, mounts=mounts)
            if claim.ref.uid not in failed:
                out.append(replace(claim, shares=shares) if shares else claim)
        return out, failed

    async def _ensure(self, gpu: str, memory: int) -> MpsDaemon | ClaimError:
        what = f"starting the MPS control daemon of GPU {gpu}"
        try:
            async with asyncio.timeout(self._timeout):
                daemon = await self._mps.ensure(gpu)
                if gpu not in self._running:
                    # defaults for the daemon's servers: the whole GPU; each share's own limits tighten them
                    await self._mps.set_limits(gpu, active_thread_percentage=100, pinned_memory_mib=memory >> 20)
        except PartitionError as exc:
            self.last_error = f"{what} failed ({exc.kind.value}): {exc}"
            log.warning("dra.mps_failed", gpu=gpu, kind=exc.kind.value, error=str(exc))
            return ClaimError(Reason.MPS_ERROR, self.last_error)
        except TimeoutError:
            self.last_error = f"{what} took longer than {self._timeout:g}s"
            return ClaimError(Reason.MPS_ERROR, self.last_error)
        if gpu not in self._running:
            log.info("dra.mps_running", gpu=gpu, pipe_dir=str(daemon.pipe_dir))
        self._running[gpu] = daemon
        return daemon

    async def resume(self, gpus: Iterable[tuple[str, int]]) -> None:
        """After a restart: the daemons of GPUs whose MPS shares are still prepared (gpu, memory bytes)."""
        for gpu, memory in gpus:
            await self._ensure(gpu, memory)

    async def release_unused(self, in_use: Callable[[str], bool]) -> None:
        """Stop the daemons of GPUs ``in_use`` says no MPS share holds any more."""
        for gpu in [g for g in self._running if not in_use(g)]:
            try:
                async with asyncio.timeout(self._timeout):
                    await self._mps.release(gpu)
            except (PartitionError, TimeoutError) as exc:
                self.last_error = f"stopping the MPS control daemon of GPU {gpu} failed: {exc!r}"
                log.warning("dra.mps_release_failed", gpu=gpu, error=str(exc))
                continue
            del self._running[gpu]
            log.info("dra.mps_released", gpu=gpu)

    def debug_state(self) -> dict[str, object]:
        return {
            "daemons": sorted(self._running),
            "last_error": self.last_error or None,
            "control": self._mps.status(),
        }


def _mps(planned: PlannedDevice) -> bool:
    """A share that runs under MPS."""
    return planned.share_memory is not None and planned.device.share is not None and planned.device.share.mps
