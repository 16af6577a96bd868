"""What operators see of handovers: Kubernetes Events on the Node and counters.

:class:`HandoverEvents` is the :class:`~agent.core.ownership.handover.HandoverListener` the agent installs:
each drain that starts, completes, or waits longer than ``ownership.handover_warning_s`` becomes
an Event (warnings for long waits and for index overrides that now name another GPU), and a
counter by outcome. Without API access only the counters and the log lines remain.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from agent.core.config.schema import Owner
from agent.core.eventsink import EventSink
from agent.core.ownership.table import Drain


class HandoverEvents:
    def __init__(self, *, events: EventSink | None, registry: CollectorRegistry | None = None) -> None:
        self._events = events
        self._outcomes = Counter(
            "gpu_agent_handovers",
            "GPU handovers between mechanisms by outcome: started, completed, cancelled (back to the old "
            "owner), waiting (past ownership.handover_warning_s)",
            ["outcome"],
            registry=registry,
        )
        self._index_moves = Counter(
            "gpu_agent_index_override_moves",
            "Per-GPU ownership overrides by index that now name another GPU (a GPU fell off the bus)",
            registry=registry,
        )
        for outcome in ("started", "completed", "cancelled", "waiting"):
            self._outcomes.labels(outcome=outcome)

    def started(self, gpu: str, drain: Drain) -> None:
        self._outcomes.labels(outcome="started").inc()
        waiting = f"; waiting: {drain.waiting_for}" if drain.waiting_for else ""
        self._normal(
            "GPUHandoverStarted", f"GPU {gpu} moves from {drain.source.value} to {drain.target.value}{waiting}"
        )

    def completed(self, gpu: str, source: Owner, target: Owner, waited_s: float) -> None:
        if target is source:
            self._outcomes.labels(outcome="cancelled").inc()
            self._normal("GPUHandoverCancelled", f"GPU {gpu} stays with {source.value} (the config changed back)")
            return
        self._outcomes.labels(outcome="completed").inc()
        self._normal(
            "GPUHandoverCompleted", f"GPU {gpu} moved from {source.value} to {target.value} after {waited_s:.1f}s"
        )

    def waiting_long(self, gpu: str, drain: Drain, waited_s: float) -> None:
        self._outcomes.labels(outcome="waiting").inc()
        if self._events is not None:
            self._events.warning(
                "GPUHandoverWaiting",
                f"GPU {gpu} has waited {waited_s:.0f}s to move from {drain.source.value} to "
                f"{drain.target.value}: {drain.waiting_for}; it is not forced",
            )

    def index_moved(self, key: str, old_uuid: str, new_uuid: str) -> None:
        self._index_moves.inc()
        if self._events is not None:
            self._events.warning(
                "GPUIndexOverrideMoved",
                f"{key} now names GPU {new_uuid} (it named {old_uuid}); running pods on either stay "
                "protected by the handover",
            )

    def _normal(self, reason: str, message: str) -> None:
        if self._events is not None:
            self._events.normal(reason, message)
