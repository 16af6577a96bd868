"""A sleep for backoff loops that records each delay and holds the sleeper until the test lets it go."""

from __future__ import annotations

import asyncio

from tests.fake_apiserver import TIMEOUT


class FakeSleep:
    def __init__(self) -> None:
        self.delays: list[float] = []
        self._pending: asyncio.Queue[asyncio.Future[None]] = asyncio.Queue()

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.put_nowait(waiter)
        await waiter

    async def next(self) -> asyncio.Future[None]:
        """Wait for the next sleep to start; end it by setting the returned future's result."""
        return await asyncio.wait_for(self._pending.get(), TIMEOUT)

    async def release(self) -> None:
        """Wait for the next sleep to start, then end it."""
        (await self.next()).set_result(None)

    def release_all(self) -> None:
        """End every sleep that has started."""
        while not self._pending.empty():
            self._pending.get_nowait().set_result(None)
