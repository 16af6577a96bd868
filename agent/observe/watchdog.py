"""The registration watchdog: what the agent advertises against what the node really shows.

Every ``watchdog.interval_s`` it takes the Node's ``status.allocatable`` as the Node watch last
brought it (``agent/kube/labels.py``: no request of its own) and asks each mechanism for its
:class:`~agent.core.mechanism.RegistrationCheck` s: the device plugin compares the healthy devices of
each resource with the kubelet's ``GetAllocatableResources`` and with the Node's count; DRA
compares the devices its pool should hold with those its ResourceSlices hold. A check whose
other side cannot be read now is skipped.

A disagreement is the kubelet or the API catching up until it lasts ``watchdog.grace_s`` (the
kubelet posts node status every 10 s and PodResources is re-read every 10 s, so the default
30 s leaves a margin). Past that it is *repaired* through the mechanism's own path (the device
plugin server stops, pauses so the kubelet handles the end of its stream, then serves and
registers again; the publisher re-lists and re-publishes),
logged once with a Warning Event, and counted. While it lasts, the repair is retried ever less
often (every ``grace_s`` times the number of repairs so far).

Readiness: a disagreement being repaired is a note on ``/readyz`` (the agent is doing what it
should); one that survives ``watchdog.max_repairs`` repairs makes the agent not ready, because
then the node advertises something the agent cannot put right and an operator must look.
When the two sides agree again, a repaired disagreement is logged and an Event says so.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.core.config.current import ConfigState
from agent.core.eventsink import EventSink
from agent.core.mechanism import Mechanism, Readiness
from agent.kube.nodestatus import NodeStatusSource

log = structlog.get_logger("agent.watchdog")

#: the longest wait between two repairs of one disagreement, in grace periods
MAX_BACKOFF = 10


@dataclass(slots=True)
class _Disagreement:
    mechanism: str
    check: str
    since: float
    detail: str
    repairs: int = 0
    last_repair: float | None = None

    @property
    def name(self) -> str:
        return f"{self.mechanism} {self.check}"


class Watchdog:
    def __init__(
        self,
        *,
        mechanisms: Mapping[str, Mechanism],
        node: NodeStatusSource,
        config: ConfigState,
        has_gpus: Callable[[], bool] = lambda: True,
        events: EventSink | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._mechanisms = mechanisms
        self._node = node
        self._config = config
        self._has_gpus = has_gpus
        self._events = events
        self._clock = clock
        self._open: dict[tuple[str, str], _Disagreement] = {}
        self.rounds = 0
        self.checks = 0
        self.repairs = 0
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._repairs = Counter(
            "gpu_agent_watchdog_repairs",
            "Repairs of a lasting disagreement between what the agent advertises and what the node shows "
            "(device plugin: register again; DRA: re-list and re-publish the slices)",
            ["mechanism", "check"],
            registry=registry,
        )
        self._gauge = Gauge(
            "gpu_agent_watchdog_disagreements",
            "Disagreements now between what the agent advertises and what the node shows: pending (within "
            "watchdog.grace_s), repairing, failing (past watchdog.max_repairs)",
            ["state"],
            registry=registry,
        )
        for state in ("pending", "repairing", "failing"):
            self._gauge.labels(state=state).set(0)

    # --- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            config = self._config.config.watchdog
            if config.enabled and self._has_gpus():
                await self._node.refresh()
                self.evaluate()
            elif self._open:
                self._open.clear()
                self._update_gauge()
            await asyncio.sleep(config.interval_s)

    def evaluate(self) -> None:
        """One round of comparisons and the repairs they call for; no I/O, never raises."""
        config = self._config.config.watchdog
        now = self._clock()
        self.rounds += 1
        status = self._node.status
        current: set[tuple[str, str]] = set()
        for name, mechanism in self._mechanisms.items():
            for check in mechanism.registration_checks(status):
                if check.seen is None:
                    continue
                self.checks += 1
                key = (name, check.key)
                if check.agrees:
                    continue
                current.add(key)
                found = self._open.get(key)
                if found is None:
                    found = self._open[key] = _Disagreement(name, check.key, since=now, detail=check.detail)
                found.detail = check.detail
                if self._repair_due(found, now, config.grace_s):
                    self._repair(found, now, check.repair)
        for key in set(self._open) - current:
            self._agreed(self._open.pop(key), now)
        self._update_gauge()

    @staticmethod
    def _repair_due(found: _Disagreement, now: float, grace_s: float) -> bool:
        if now - found.since < grace_s:
            return False
        if found.last_repair is None:
            return True
        return now - found.last_repair >= grace_s * min(found.repairs, MAX_BACKOFF)

    def _repair(self, found: _Disagreement, now: float, repair: Callable[[str], None]) -> None:
        if found.repairs == 0:
            log.warning(
                "the node disagrees with what the agent advertises; repairing",
                mechanism=found.mechanism,
                check=found.check,
                detail=found.detail,
                lasting_s=round(now - found.since, 1),
            )
            if self._events is not None:
                self._events.warning("AdvertisementDiverged", f"{found.name}: {found.detail}; repairing")
        found.repairs += 1
        found.last_repair = now
        self.repairs += 1
        self._repairs.labels(mechanism=found.mechanism, check=found.check).inc()
        try:
            repair(found.detail)
        except Exception:  # a repair that fails is tried again after the backoff
            log.exception("watchdog repair failed", mechanism=found.mechanism, check=found.check)

    def _agreed(self, found: _Disagreement, now: float) -> None:
        if not found.repairs:
            return  # a moment's lag, not worth a line
        log.info(
            "the node agrees with the agent again",
            mechanism=found.mechanism,
            check=found.check,
            repairs=found.repairs,
            after_s=round(now - found.since, 1),
        )
        if self._events is not None:
            self._events.normal("AdvertisementRepaired", f"{found.name} agrees again after {found.repairs} repair(s)")

    def _state_of(self, found: _Disagreement) -> str:
        if found.repairs >= self._config.config.watchdog.max_repairs:
            return "failing"
        return "repairing" if found.repairs else "pending"

    def _update_gauge(self) -> None:
        counts = {"pending": 0, "repairing": 0, "failing": 0}
        for found in self._open.values():
            counts[self._state_of(found)] += 1
        for state, n in counts.items():
            self._gauge.labels(state=state).set(n)

    # --- views ------------------------------------------------------------------------------

    def readiness(self) -> Readiness:
        """Not ready only while a disagreement outlives ``max_repairs`` repairs; a note while repairing."""
        failing = [f for f in self._open.values() if self._state_of(f) == "failing"]
        if failing:
            f = failing[0]
            return Readiness(False, f"{f.name} still disagrees after {f.repairs} repairs: {f.detail}")
        repairing = [f for f in self._open.values() if f.repairs]
        if repairing:
            f = repairing[0]
            return Readiness(True, f"repairing {f.name} (repair {f.repairs}): {f.detail}")
        return Readiness(True)

    def debug_state(self) -> dict[str, object]:
        config = self._config.config.watchdog
        now = self._clock()
        status = self._node.status
        return {
            "enabled": config.enabled,
            "interval_s": config.interval_s,
            "grace_s": config.grace_s,
            "node_allocatable": dict(status.allocatable) if status.allocatable is not None else None,
            "node_status_error": status.reason or None,
            "rounds": self.rounds,
            "comparisons": self.checks,
            "repairs": self.repairs,
            "disagreements": [
                {
                    "mechanism": f.mechanism,
                    "check": f.check,
                    "state": self._state_of(f),
                    "for_s": round(now - f.since, 1),
                    "repairs": f.repairs,
                    "detail": f.detail,
                }
                for f in self._open.values()
            ],
        }
