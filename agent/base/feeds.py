"""A small in-process pub/sub: one publisher, many subscribers, nothing blocks the publisher.

Subscribers that stop reading cannot grow memory: each has a bounded queue and, when it is
full, the oldest item is dropped (every event here is a notification that a fresh read of
the source of truth answers, so losing an old one loses nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Subscription(Generic[T]):
    def __init__(self, maxsize: int) -> None:
        self._queue: asyncio.Queue[T] = asyncio.Queue(maxsize=maxsize)
        self.dropped = 0

    def _offer(self, item: T) -> None:
        if self._queue.full():
            self._queue.get_nowait()
            self.dropped += 1
        self._queue.put_nowait(item)

    async def get(self) -> T:
        return await self._queue.get()

    def get_nowait(self) -> T | None:
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def drain(self) -> list[T]:
        items: list[T] = []
        while (item := self.get_nowait()) is not None:
            items.append(item)
        return items

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        return await self._queue.get()


class Broadcast(Generic[T]):
    """Fan one stream of events out to every current subscriber. Loop-thread only."""

    def __init__(self, *, maxsize: int = 64) -> None:
        self._maxsize = maxsize
        self._subscribers: set[Subscription[T]] = set()

    def publish(self, item: T) -> None:
        for sub in self._subscribers:
            sub._offer(item)

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[Subscription[T]]:
        sub: Subscription[T] = Subscription(self._maxsize)
        self._subscribers.add(sub)
        try:
            yield sub
        finally:
            self._subscribers.discard(sub)

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)
