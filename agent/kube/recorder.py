"""Kubernetes Events about this node (core/v1 Event on the Node object), never blocking the caller.

:meth:`EventRecorder.record` puts the event in a bounded queue and returns; a full queue drops
it and counts the drop. :meth:`EventRecorder.run` drains the queue and writes, with the
behaviour of client-go's ``EventCorrelator`` (``k8s.io/client-go/tools/record/events_cache.go``),
so that a condition that lasts does not add objects to etcd for as long as it lasts:

* *one object per series*: the first event with a given (type, reason, message) is created
  (POST); repeats are counted and written into that same object (PATCH of ``count`` and
  ``lastTimestamp``). As in the events.k8s.io series (``k8s.io/client-go/tools/events``), the
  first repeat is written at once (the object now says "x2"), later ones are counted and written
  when the series has been quiet for ``finish_s`` (6 minutes: the final count) or, while it goes
  on, every ``refresh_s`` (30 minutes). So a storm of 1,000 costs three requests and the object
  says 1,000, and a condition that lasts a day costs about fifty. An object the server has
  dropped (Events live an hour) is created again, carrying the count;
* *aggregation*: when one (type, reason) comes with ``aggregate_after`` different messages within
  ``aggregate_window_s``, further ones join one series whose message reads
  ``(combined from similar events): <the latest>``;
* *a budget*: every write takes a token from a bucket of ``burst`` that refills one token every
  ``refill_s`` (client-go: 25, one per 5 minutes per source and object; here one object, the
  Node). Past it nothing is lost: occurrences are counted and written when a token comes, new
  series before repeats. So in steady state the agent writes at most one Event every five minutes,
  whatever it records.

The involved object's ``uid`` is the node's name, as the kubelet writes it: ``kubectl describe
node`` finds node events by that. Events are best effort: a failed write is counted and logged
once per failure streak, and tried again a minute later within the same budget. At most ``max_series``
series are remembered (the oldest is forgotten first).

RBAC: ``create`` and ``patch`` on ``events`` in ``default`` (``config/base/rbac.yaml``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal
from urllib.parse import quote

import structlog
from prometheus_client import CollectorRegistry, Counter

from agent.kube.client import KubeClient
from agent.kube.errors import KubeError, KubeNotFoundError

log = structlog.get_logger("agent.kube.events")

EventType = Literal["Normal", "Warning"]
COMPONENT = "gpu-node-agent"
#: Events are namespaced; a cluster-scoped object's go to "default", as the kubelet's do
NAMESPACE = "default"
MAX_MESSAGE_BYTES = 1024
MAX_REASON_CHARS = 128
COMBINED = "(combined from similar events): "
OUTCOMES = ("created", "repeated", "dropped", "failed")
#: a write that failed is tried again after this (and only while the budget allows)
RETRY_S = 60.0


@dataclass(slots=True)
class _Series:
    """One Event object and the occurrences it stands for."""

    type: EventType
    reason: str
    message: str
    first_wall: str
    last_wall: str
    #: when the latest occurrence was recorded (monotonic)
    seen_at: float
    count: int = 1
    #: the object's name once created ("" before, or after the server dropped it)
    name: str = ""
    #: the count the server has
    written: int = 0
    last_write_at: float | None = None
    #: after a failed write, not before this
    retry_at: float = 0.0


@dataclass(slots=True)
class _Similar:
    """Distinct messages of one (type, reason) lately, for aggregation."""

    messages: set[str]
    last_at: float


@dataclass(frozen=True, slots=True)
class _Item:
    type: EventType
    reason: str
    message: str
    wall: str


class _Tokens:
    """A token bucket: ``burst`` tokens, one more every ``refill_s``."""

    def __init__(self, burst: int, refill_s: float, clock: Callable[[], float]) -> None:
        self._burst = burst
        self._refill_s = refill_s
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()

    def _fill(self) -> None:
        now = self._clock()
        self._tokens = min(float(self._burst), self._tokens + (now - self._at) / self._refill_s)
        self._at = now

    def take(self) -> bool:
        self._fill()
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def next_at(self) -> float:
        """When the next token is there."""
        self._fill()
        return self._clock() + max(0.0, 1.0 - self._tokens) * self._refill_s


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
        finish_s: float = 360.0,
        refresh_s: float = 1800.0,
        burst: int = 25,
        refill_s: float = 300.0,
        aggregate_after: int = 10,
        aggregate_window_s: float = 600.0,
        max_series: int = 256,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], str] = _utc_now,
    ) -> None:
        self._client = client
        self.node_name = node_name
        self._queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=queue_size)
        self._finish_s = finish_s
        self._refresh_s = refresh_s
        self._aggregate_after = aggregate_after
        self._aggregate_window_s = aggregate_window_s
        self._max_series = max_series
        self._clock = clock
        self._wall = wall
        self._tokens = _Tokens(burst, refill_s, clock)
        self._series: OrderedDict[tuple[EventType, str, str], _Series] = OrderedDict()
        self._similar: OrderedDict[tuple[EventType, str], _Similar] = OrderedDict()
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._counter = Counter(
            "gpu_agent_kube_events_total",
            "Kubernetes Events by outcome: created, repeated (the count written into the existing object), "
            "dropped (queue full), failed",
            ["outcome"],
            registry=registry,
        )
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
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
        unwritten = sum(s.count - s.written for s in self._series.values())
        return {
            "queued": self._queue.qsize(),
            "series": len(self._series),
            "unwritten": unwritten,
            **self.outcomes,
            "last_error": self.last_error or None,
        }

    # --- the drain task ------------------------------------------------------------------

    async def run(self) -> None:
        """Drain the queue and write what is due, until cancelled."""
        while True:
            due = self._next_write()
            item: _Item | None = None
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the cancellation that
            # arrives as the queue answers, and shutdown would then wait for this task forever
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if due is None else max(0.0, due - self._clock())):
                    item = await self._queue.get()
            if item is not None:
                self._absorb(item)
            await self._write_due()

    def _absorb(self, item: _Item) -> None:
        combined = self._combined(item)
        message = _cut_message(COMBINED + item.message) if combined else item.message
        key = (item.type, item.reason, COMBINED if combined else item.message)
        now = self._clock()
        found = self._series.get(key)
        if found is not None:
            found.count += 1
            found.last_wall, found.seen_at, found.message = item.wall, now, message
            self._series.move_to_end(key)
            return
        while len(self._series) >= self._max_series:
            self._series.popitem(last=False)
        self._series[key] = _Series(
            item.type, item.reason, message, first_wall=item.wall, last_wall=item.wall, seen_at=now
        )

    def _combined(self, item: _Item) -> bool:
        """Whether the item joins its reason's combined series (too many different messages lately)."""
        now = self._clock()
        key = (item.type, item.reason)
        similar = self._similar.get(key)
        if similar is None or now - similar.last_at > self._aggregate_window_s:
            similar = _Similar(set(), now)
        similar.messages.add(item.message)
        similar.last_at = now
        self._similar[key] = similar
        self._similar.move_to_end(key)
        while len(self._similar) > self._max_series:
            self._similar.popitem(last=False)
        if len(similar.messages) < self._aggregate_after:
            return False
        similar.messages.pop()  # never grows past the threshold
        return True

    def _due_at(self, series: _Series) -> float | None:
        """When the series' unwritten occurrences are to be written (None: nothing to write)."""
        if series.count <= series.written:
            return None
        if series.last_write_at is None or series.written <= 1:
            due = series.seen_at  # new, or its first repeat: the object says "x2" at once
        else:
            due = min(series.seen_at + self._finish_s, series.last_write_at + self._refresh_s)
        return max(due, series.retry_at)

    def _next_write(self) -> float | None:
        due = [at for s in self._series.values() if (at := self._due_at(s)) is not None]
        if not due:
            return None
        return max(min(due), self._tokens.next_at())

    async def _write_due(self) -> None:
        now = self._clock()
        due = [s for s in self._series.values() if (at := self._due_at(s)) is not None and at <= now]
        # new series first: a new condition matters more than the count of an old one
        for series in sorted(due, key=lambda s: s.written > 0):
            if not self._tokens.take():
                return
            await self._write(series)

    async def _write(self, series: _Series) -> None:
        count = series.count
        series.last_write_at = self._clock()
        try:
            if series.name:
                try:
                    await self._patch(series, count)
                except KubeNotFoundError:
                    series.name = ""  # the server dropped it (Events live an hour): start it again
            if not series.name:
                await self._create(series, count)
        except KubeError as exc:
            series.retry_at = series.last_write_at + RETRY_S
            self._failed(exc)
            return
        outcome = "created" if series.written == 0 else "repeated"
        series.written = count
        self._count(outcome)

    async def _create(self, series: _Series, count: int) -> None:
        name = f"{self.node_name}.{time.time_ns():x}"
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": self.node_name},
            "reason": series.reason,
            "message": series.message,
            "type": series.type,
            "count": count,
            "firstTimestamp": series.first_wall,
            "lastTimestamp": series.last_wall,
            "source": {"component": COMPONENT, "host": self.node_name},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.node_name,
        }
        await self._client.create(f"/api/v1/namespaces/{NAMESPACE}/events", body)
        series.name = name

    async def _patch(self, series: _Series, count: int) -> None:
        body: dict[str, object] = {"count": count, "lastTimestamp": series.last_wall}
        if series.message.startswith(COMBINED):
            body["message"] = series.message
        await self._client.patch(f"/api/v1/namespaces/{NAMESPACE}/events/{quote(series.name, safe='')}", body)

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self._counter.labels(outcome=outcome).inc()
        if outcome in ("created", "repeated") and self.last_error:
            log.info("events are written again")
            self.last_error = ""

    def _failed(self, exc: KubeError) -> None:
        self._count("failed")
        if not self.last_error:
            hint = (
                " (the service account needs create and patch on events in the default namespace)"
                if exc.status == 403
                else ""
            )
            log.warning("cannot write Kubernetes events" + hint, error=str(exc))
        self.last_error = str(exc)


def _cut_message(message: str) -> str:
    data = message.encode()
    if len(data) <= MAX_MESSAGE_BYTES:
        return message
    return data[: MAX_MESSAGE_BYTES - 3].decode(errors="ignore") + "..."
