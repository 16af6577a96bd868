"""List a collection once, then follow it with one watch, as client-go's reflector does.

One agent runs on every GPU node, so what it asks of the API server in steady state is multiplied
by the fleet. :class:`ListWatch` keeps that to one open stream per collection:

* it lists (from the API server's watch cache, ``resourceVersion=0``) and then watches from the
  list's resourceVersion with ``allowWatchBookmarks``; every event and bookmark advances the
  resourceVersion, so a stream that ends (the server ends each one after ``timeoutSeconds``) or
  breaks is resumed where it stopped, without a list;
* ``timeoutSeconds`` is drawn anew for every stream from [``min_timeout_s``, twice ``min_timeout_s``),
  as the reflector does (``k8s.io/client-go/tools/cache/reflector.go``: 5 to 10 minutes): the
  streams of a fleet started together do not all end together;
* only 410 Gone (the resourceVersion left the server's window, as after an API server restart)
  lists again: from the last resourceVersion seen (the watch cache answers "not older than"), or
  from etcd if the server refuses that too;
* every retry after an error, and every list after a 410, waits a backoff with wide jitter
  (:data:`WATCH_BACKOFF`): when an API server restarts, every node's streams break at the same
  moment, and without jitter they would all come back, and list, in the same second.

The owner gets the list (``on_list``) and each event (``on_event``) and keeps what it needs; this
module keeps only the resourceVersion and whether the owner's view can be trusted now
(:meth:`ListWatch.fresh`): no failure since, and the server said something (took the watch,
sent an event or a bookmark, answered a list) within ``fresh_s``. A real API server sends a
bookmark to every watcher about once a minute (``k8s.io/apiserver/pkg/storage/cacher``), so once
a stream has carried a bookmark, ``fresh_s`` of silence on it means a dead connection: the
stream is dropped and resumed, long before the socket's idle limit would notice. (A server that
sends no bookmarks is left to that limit.)

Bounds: a list is at most the client's ``list_bytes``, an event its ``watch_line_bytes``; a list
or a stream that stops answering is cut by the client's request and idle limits; the owner bounds
how many objects it keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from agent.base.backoff import Backoff
from agent.kube.client import JSON, KubeClient
from agent.kube.errors import KubeError, KubeGoneError

log = structlog.get_logger("agent.kube")

Sleep = Callable[[float], Awaitable[None]]
Clock = Callable[[], float]

#: retries of watches and lists: 1 s doubling to 30 s, each delay drawn from [½, 1½] of it
WATCH_BACKOFF = Backoff(initial_s=1.0, factor=2.0, max_s=30.0, jitter=0.5)
#: the reflector's minimum watch timeout; each stream asks for 1 to 2 times this
MIN_WATCH_TIMEOUT_S = 300.0
#: three missed bookmarks (the API server sends one about every minute)
FRESH_S = 150.0


@dataclass(frozen=True, slots=True)
class WatchTiming:
    """How a watch waits: the production values by default, a fake sleep and clock in tests."""

    backoff: Backoff = WATCH_BACKOFF
    sleep: Sleep = asyncio.sleep
    clock: Clock = time.monotonic
    #: each stream asks the server for a timeout of 1 to 2 times this
    min_timeout_s: float = MIN_WATCH_TIMEOUT_S
    #: the view is current while the server was heard from within this
    fresh_s: float = FRESH_S
    #: a stream that ends cleanly sooner than this, with no events, counts as a failure
    min_watch_s: float = 1.0


PRODUCTION = WatchTiming()


class ListWatch:
    """List-then-watch of one collection (a path and its selectors), until cancelled.

    ``on_list(items)`` replaces the owner's view with a full list; ``on_event(type, object)``
    applies one ADDED, MODIFIED or DELETED event (bookmarks and errors never reach it). Either may
    raise KubeError to say the answer is unusable; that counts as a failure like any other.
    ``on_error(exc)`` hears every failure and ``on_recovered()`` the first success after some, so
    the owner can log a failure streak once, in its own words.
    """

    def __init__(
        self,
        client: KubeClient,
        *,
        path: str,
        params: Mapping[str, str],
        on_list: Callable[[list[Any]], None],
        on_event: Callable[[str, dict[str, Any]], None],
        on_error: Callable[[KubeError], None] = lambda exc: None,
        on_recovered: Callable[[], None] = lambda: None,
        accept: str = JSON,
        list_accept: str = JSON,
        timing: WatchTiming = PRODUCTION,
        rng: random.Random | None = None,
    ) -> None:
        self._client = client
        self.path = path
        self._params = dict(params)
        self._on_list = on_list
        self._on_event = on_event
        self._on_error = on_error
        self._on_recovered = on_recovered
        self._accept = accept
        self._list_accept = list_accept
        self._backoff = timing.backoff
        self._sleep = timing.sleep
        self._clock = timing.clock
        self._min_timeout_s = timing.min_timeout_s
        self._fresh_s = timing.fresh_s
        self._min_watch_s = timing.min_watch_s
        self._rng = rng or random.Random()
        #: where the next watch resumes; "" means list first
        self.resource_version = ""
        #: the resourceVersion the next list asks for: "0" (the watch cache), the last one seen
        #: (after a 410), or "" (etcd, when the cache refused that too)
        self._list_from = "0"
        #: set once a list has succeeded
        self.synced = asyncio.Event()
        self.last_error = ""
        self._heard_at: float | None = None
        self._streaming = False
        self._relist_requested = False
        #: completed lists, watch streams opened, 410s, for /debug and tests
        self.lists = 0
        self.watches = 0
        self.expired = 0

    # --- what the owner reads -----------------------------------------------------------

    def fresh(self) -> bool:
        """Whether the owner's view is the server's as of moments ago: listed, no failure since,
        and the server heard from within ``fresh_s``."""
        if not self.synced.is_set() or self.last_error or self._heard_at is None:
            return False
        return self._clock() - self._heard_at < self._fresh_s

    def relist(self) -> None:
        """List again before the next stream (the owner found the view wrong); the open stream ends."""
        self._relist_requested = True

    def debug_state(self) -> dict[str, object]:
        heard = None if self._heard_at is None else round(self._clock() - self._heard_at, 1)
        return {
            "synced": self.synced.is_set(),
            "fresh": self.fresh(),
            "streaming": self._streaming,
            "resource_version": self.resource_version,
            "heard_s_ago": heard,
            "lists": self.lists,
            "watches": self.watches,
            "expired": self.expired,
            "last_error": self.last_error or None,
        }

    # --- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        """List and watch until cancelled; never raises KubeError."""
        attempt = 0
        while True:
            listing = not self.resource_version or self._relist_requested
            try:
                if listing:
                    await self._list()
                    listing = False
                started = self._clock()
                events = await self._follow()
            except KubeGoneError as exc:
                # out of the server's window: list again, after a backoff (after an API server
                # restart every node hears this at about the same moment)
                self.expired += 1
                log.info("watch expired; listing again", path=self.path, reason=str(exc))
                if listing:
                    self._list_from = ""  # even the list was refused: ask etcd
                else:
                    self._list_from, self.resource_version = self.resource_version, ""
                attempt += 1
                await self._sleep(self._backoff.delay(attempt))
                continue
            except KubeError as exc:
                self._failed(exc)
                attempt += 1
                await self._sleep(self._backoff.delay(attempt))
                continue
            if events or self._clock() - started >= self._min_watch_s:
                attempt = 0
                self._recovered()
            else:
                # ended cleanly but at once: something between us and the server closes streams
                attempt += 1
                await self._sleep(self._backoff.delay(attempt))

    async def _list(self) -> None:
        params = dict(self._params)
        if self._list_from:
            params["resourceVersion"] = self._list_from
        body = await self._client.list(self.path, params, accept=self._list_accept)
        items = body.get("items")
        if items is None and "items" in body:
            items = []  # a real API server sends an empty PartialObjectMetadataList's items as null
        if not isinstance(items, list):
            raise KubeError(f"list {self.path}: the answer has no items list", recoverable=True)
        metadata = body.get("metadata")
        version = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
        if not isinstance(version, str) or not version:
            raise KubeError(f"list {self.path}: the answer has no resourceVersion", recoverable=True)
        self._on_list(items)
        self.lists += 1
        self.resource_version, self._list_from = version, "0"
        self._relist_requested = False
        self._heard()
        self._recovered()
        self.synced.set()

    async def _follow(self) -> int:
        """Follow one stream from the current resourceVersion; the number of events it carried."""
        timeout_s = self._min_timeout_s * (1.0 + self._rng.random())
        params = {**self._params, "resourceVersion": self.resource_version, "allowWatchBookmarks": "true"}
        events = 0
        #: once the server has sent a bookmark it sends one about every minute: silence is a dead stream
        silence_limit: float | None = None
        stream = self._client.watch(self.path, params, timeout_s=timeout_s, accept=self._accept, on_open=self._opened)
        self.watches += 1
        try:
            async with contextlib.aclosing(stream) as stream_events:
                while not self._relist_requested:
                    try:
                        async with asyncio.timeout(silence_limit):
                            event = await anext(stream_events)
                    except StopAsyncIteration:
                        break
                    except TimeoutError:
                        raise KubeError(
                            f"watch {self.path}: nothing for {silence_limit:g}s from a server that sends bookmarks",
                            recoverable=True,
                        ) from None
                    events += 1
                    kind, obj = event["type"], event["object"]
                    if kind == "BOOKMARK":
                        silence_limit = self._fresh_s
                    else:
                        self._on_event(kind, obj)
                    metadata = obj.get("metadata")
                    version = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
                    if isinstance(version, str) and version:
                        self.resource_version = version
                    self._heard()
        finally:
            self._streaming = False
        return events

    def _opened(self) -> None:
        """The server took the watch from our resourceVersion: the view is current as of now."""
        self._streaming = True
        self._heard()
        self._recovered()

    def _heard(self) -> None:
        self._heard_at = self._clock()

    def _failed(self, exc: KubeError) -> None:
        self._on_error(exc)  # before: the owner can tell the first failure of a streak by last_error
        self.last_error = str(exc)

    def _recovered(self) -> None:
        if self.last_error:
            self.last_error = ""
            self._on_recovered()
