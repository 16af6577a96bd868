"""Kubernetes Events about this node (core/v1 Event on the Node object), never blocking the caller.

:meth:`EventRecorder.record` puts the event in a bounded queue and returns; a full queue drops
it and counts the drop. :meth:`EventRecorder.run` drains the queue:

* the first event with a given (type, reason, message) is created (POST);
* repeats within ``window_s`` are counted, and at most once per ``repeat_interval_s`` a new
  Event object is created carrying the count so far (``count``, ``firstTimestamp`` of the
  series): a storm of 1,000 identical events costs a handful of requests, and the newest
  object still says 1,000. Only ``create`` is needed: the agent's RBAC grants nothing more on
  events (a PATCH-based aggregation like the kubelet's would need ``patch`` too).

The involved object's ``uid`` is the node's name, as the kubelet writes it: ``kubectl describe
node`` finds node events by that. Events are best effort: a failed write is counted and logged
once per failure streak, and nothing is retried beyond the next repeat.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

import structlog
from prometheus_client import CollectorRegistry, Counter

from agent.kube.client import KubeClient
from agent.kube.errors import KubeError

log = structlog.get_logger("agent.kube.events")

EventType = Literal["Normal", "Warning"]
COMPONENT = "gpu-node-agent"
#: Events are namespaced; a cluster-scoped object's go to "default", as the kubelet's do
NAMESPACE = "default"
MAX_MESSAGE_BYTES = 1024
MAX_REASON_CHARS = 128


@dataclass(slots=True)
class _Aggregate:
    name: str
    count: int
    first_at: float
    first_wall: str
    #: count the server has; the difference waits for the next repeat event
    written: int
    last_write_at: float


@dataclass(frozen=True, slots=True)
class _Item:
    type: EventType
    reason: str
    message: str
    wall: str


def _utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class EventRecorder:
    def __init__(
        self,
        *,
        client: KubeClient,
        node_name: str,
        registry: CollectorRegistry | None = None,
        queue_size: int = 128,
        window_s: float = 600.0,
        repeat_interval_s: float = 60.0,
        max_aggregates: int = 256,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], str] = _utc_now,
    ) -> None:
        self._client = client
        self.node_name = node_name
        self._queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=queue_size)
        self._window_s = window_s
        self._repeat_interval_s = repeat_interval_s
        self._max_aggregates = max_aggregates
        self._clock = clock
        self._wall = wall
        self._aggregates: OrderedDict[tuple[EventType, str, str], _Aggregate] = OrderedDict()
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._counter = Counter(
            "gpu_agent_kube_events_total",
            "Kubernetes Events by outcome: created, repeated (a new object with the count), dropped, failed",
            ["outcome"],
            registry=registry,
        )
        self.outcomes = dict.fromkeys(("created", "repeated", "dropped", "failed"), 0)
        self.last_error = ""

    # --- callers ---------------------------------------------------------------------------

    def normal(self, reason: str, message: str) -> None:
        self.record("Normal", reason, message)

    def warning(self, reason: str, message: str) -> None:
        self.record("Warning", reason, message)

    def record(self, type_: EventType, reason: str, message: str) -> None:
        """Queue an event about the node; never blocks, never raises (a full queue drops it)."""
        item = _Item(type_, reason[:MAX_REASON_CHARS], _cut_message(message), self._wall())
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            self._count("dropped")
            log.debug("event dropped: queue full", reason=item.reason)

    def debug_state(self) -> dict[str, object]:
        return {"queued": self._queue.qsize(), **self.outcomes, "last_error": self.last_error or None}

    # --- the drain task ------------------------------------------------------------------

    async def run(self) -> None:
        """Drain the queue until cancelled."""
        while True:
            due = self._next_flush()
            item: _Item | None = None
            try:
                # asyncio.timeout, not wait_for: on 3.11 a cancellation that arrives as wait_for's
                # timer fires can be lost, and shutdown then waits on this task for ever
                async with asyncio.timeout(None if due is None else max(0.0, due - self._clock())):
                    item = await self._queue.get()
            except TimeoutError:
                item = None
            if item is not None:
                await self._absorb(item)
            await self._flush_due()

    async def _absorb(self, item: _Item) -> None:
        key = (item.type, item.reason, item.message)
        now = self._clock()
        found = self._aggregates.get(key)
        if found is not None and now - found.first_at < self._window_s:
            found.count += 1
            self._aggregates.move_to_end(key)
            return
        self._aggregates.pop(key, None)
        while len(self._aggregates) >= self._max_aggregates:
            self._aggregates.popitem(last=False)
        aggregate = _Aggregate(name="", count=1, first_at=now, first_wall=item.wall, written=0, last_write_at=now)
        self._aggregates[key] = aggregate
        await self._create(item.type, item.reason, item.message, aggregate, item.wall)

    def _next_flush(self) -> float | None:
        pending = [a.last_write_at + self._repeat_interval_s for a in self._aggregates.values() if a.count > a.written]
        return min(pending, default=None)

    async def _flush_due(self) -> None:
        now = self._clock()
        for (type_, reason, message), aggregate in list(self._aggregates.items()):
            if aggregate.count > aggregate.written and now - aggregate.last_write_at >= self._repeat_interval_s:
                await self._create(type_, reason, message, aggregate, self._wall(), outcome="repeated")

    async def _create(
        self, type_: EventType, reason: str, message: str, aggregate: _Aggregate, wall: str, outcome: str = "created"
    ) -> None:
        aggregate.name = f"{self.node_name}.{time.time_ns():x}"
        count = aggregate.count
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": aggregate.name, "namespace": NAMESPACE},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": self.node_name},
            "reason": reason,
            "message": message,
            "type": type_,
            "count": count,
            "firstTimestamp": aggregate.first_wall,
            "lastTimestamp": wall,
            "source": {"component": COMPONENT, "host": self.node_name},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.node_name,
        }
        aggregate.last_write_at = self._clock()
        aggregate.written = count  # best effort: a failed write is not retried
        try:
            await self._client.create(f"/api/v1/namespaces/{NAMESPACE}/events", body)
        except KubeError as exc:
            self._failed(exc)
            return
        self._count(outcome)

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self._counter.labels(outcome=outcome).inc()
        if outcome in ("created", "repeated") and self.last_error:
            log.info("events are written again")
            self.last_error = ""

    def _failed(self, exc: KubeError) -> None:
        self._count("failed")
        if not self.last_error:
            hint = " (the service account needs create on events in the default namespace)" if exc.status == 403 else ""
            log.warning("cannot write Kubernetes events" + hint, error=str(exc))
        self.last_error = str(exc)


def _cut_message(message: str) -> str:
    data = message.encode()
    if len(data) <= MAX_MESSAGE_BYTES:
        return message
    return data[: MAX_MESSAGE_BYTES - 3].decode(errors="ignore") + "..."
