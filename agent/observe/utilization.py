"""How busy each GPU and MIG device is: the backend sampled on an interval, never on the loop.

:class:`UtilizationSampler` asks the backend for a reading every ``metrics.utilization_interval_s``
(the config is re-read each round, so a live reload applies) and keeps the newest one. The
backend call is bounded: a reading that takes longer than one interval is left running and not
waited for, and no second one starts while it runs (a hung NVML call ties up one thread,
never a pile of them). A reading older than ``metrics.utilization_stale_intervals`` intervals,
or a device missing from the newest reading, is *unknown*: ``/metrics`` leaves its series
out and ``/debug/state`` says why, rather than showing a stale number as current.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter

from agent.core.config.current import ConfigState
from agent.core.inventory.current import InventoryState
from agent.core.inventory.model import Inventory
from agent.core.inventory.sample import DeviceSample

log = structlog.get_logger("agent.utilization")

RESULTS = ("ok", "error", "timeout", "busy")


class Sampler(Protocol):
    """What the sampler needs of a backend (:class:`agent.backends.backend.Backend` has it)."""

    async def sample(self, inventory: Inventory, *, busy: frozenset[str]) -> dict[str, DeviceSample]: ...


@dataclass(frozen=True, slots=True)
class Utilization:
    """One device's newest reading, or why there is none."""

    sample: DeviceSample | None
    #: seconds since the reading was taken (None: never read)
    age_s: float | None = None
    reason: str = ""

    @property
    def known(self) -> bool:
        return self.sample is not None

    def as_dict(self) -> dict[str, object]:
        """The ``utilization`` object of ``/debug/state`` (and ``gpu-agent status``)."""
        s = self.sample
        return {
            "known": self.known,
            "gpu_percent": s.gpu_percent if s else None,
            "memory_used_mib": s.memory_used_mib if s else None,
            "memory_total_mib": s.memory_total_mib if s else None,
            "age_s": round(self.age_s, 1) if self.age_s is not None else None,
            "reason": self.reason,
        }


class UtilizationSampler:
    def __init__(
        self,
        *,
        backend: Sampler,
        inventory: InventoryState,
        config: ConfigState,
        busy: Callable[[], frozenset[str]],
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._backend = backend
        self._inventory = inventory
        self._config = config
        self._busy = busy
        self._clock = clock
        self._samples: dict[str, DeviceSample] = {}
        self._taken_at: float | None = None
        self._pending: asyncio.Task[dict[str, DeviceSample]] | None = None
        self._pending_since = 0.0
        self.last_error = ""
        self.results = dict.fromkeys(RESULTS, 0)
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._counter = Counter(
            "gpu_agent_utilization_samples",
            "Utilization readings by result: ok, error (the backend failed), timeout (longer than one "
            "interval; left running), busy (skipped: the previous reading still runs)",
            ["result"],
            registry=registry,
        )
        for result in RESULTS:
            self._counter.labels(result=result)

    @property
    def interval_s(self) -> float:
        return self._config.config.metrics.utilization_interval_s

    async def run(self) -> None:
        """Sample every interval until cancelled; a reading abandoned on the way out is left to its thread."""
        try:
            while True:
                started = self._clock()
                await self.sample_once()
                await asyncio.sleep(max(0.0, self.interval_s - (self._clock() - started)))
        finally:
            if self._pending is not None:
                self._pending.cancel()

    async def sample_once(self) -> None:
        """One round: start a reading (unless one still runs) and wait at most one interval for it."""
        interval = self.interval_s
        pending = self._pending
        if pending is not None and not pending.done():
            running = self._clock() - self._pending_since
            self._fail("busy", f"the previous reading has not returned after {running:.0f}s")
            return
        inventory = self._inventory.current
        if not inventory.gpus:
            return
        task = asyncio.create_task(self._backend.sample(inventory, busy=self._busy()), name="utilization-sample")
        task.add_done_callback(_consume)
        self._pending, self._pending_since = task, self._clock()
        done, _ = await asyncio.wait({task}, timeout=interval)
        if not done:
            self._fail("timeout", f"the backend took longer than {interval:g}s to answer")
            return
        try:
            samples = task.result()
        except Exception as exc:  # a backend failure makes the values unknown, never the agent fail
            self._fail("error", f"{type(exc).__name__}: {exc}")
            return
        self._samples, self._taken_at = samples, self._clock()
        self._count("ok")
        if self.last_error:
            log.info("utilization readings work again")
            self.last_error = ""

    def _fail(self, result: str, error: str) -> None:
        self._count(result)
        if not self.last_error:
            log.warning("utilization not read; values read as unknown once stale", result=result, error=error)
        self.last_error = error

    def _count(self, result: str) -> None:
        self.results[result] += 1
        self._counter.labels(result=result).inc()

    # --- reading -----------------------------------------------------------------------

    def get(self, uuid: str) -> Utilization:
        """The device's newest reading, or unknown with the reason."""
        if self._taken_at is None:
            return Utilization(None, reason=self.last_error or "not sampled yet")
        age = self._clock() - self._taken_at
        limit = self.interval_s * self._config.config.metrics.utilization_stale_intervals
        if age > limit:
            why = f": {self.last_error}" if self.last_error else ""
            return Utilization(None, age_s=age, reason=f"the newest reading is {age:.1f}s old{why}")
        sample = self._samples.get(uuid)
        if sample is None:
            return Utilization(None, age_s=age, reason="the backend could not read this device")
        return Utilization(sample, age_s=age)

    def debug_state(self) -> dict[str, object]:
        return {
            "interval_s": self.interval_s,
            "last_sample_age_s": round(self._clock() - self._taken_at, 1) if self._taken_at is not None else None,
            "in_flight": self._pending is not None and not self._pending.done(),
            "last_error": self.last_error or None,
            "results": dict(self.results),
        }


def _consume(task: asyncio.Task[dict[str, DeviceSample]]) -> None:
    """Retrieve an abandoned reading's outcome, so asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()
