"""One lock per claim, so that two calls for one claim never interleave.

:meth:`ClaimLocks.hold` locks the claims of one call in UID order (two calls never wait on each
other in a circle), all within one deadline; a claim another call keeps busy past it is handed
back as busy, not waited for. A claim's lock exists only while some call holds or waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from agent.kube.claims.model import ClaimRef


class ClaimLocks:
    def __init__(self, timeout_s: float) -> None:
        #: how long one call waits for all its claims' locks together
        self.timeout_s = timeout_s
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}

    @contextlib.asynccontextmanager
    async def hold(self, refs: list[ClaimRef]) -> AsyncIterator[tuple[list[ClaimRef], list[ClaimRef]]]:
        """Lock each claim of a call; yields (claims locked, in call order; claims another call kept busy)."""
        held: list[ClaimRef] = []
        busy: list[ClaimRef] = []
        locks: list[str] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            for ref in sorted(refs, key=lambda r: r.uid):
                lock = self._locks.setdefault(ref.uid, asyncio.Lock())
                self._users[ref.uid] = self._users.get(ref.uid, 0) + 1
                try:
                    async with asyncio.timeout_at(deadline):
                        await lock.acquire()
                except TimeoutError:
                    self._drop(ref.uid)
                    busy.append(ref)
                    continue
                locks.append(ref.uid)
                held.append(ref)
            order = {r.uid: i for i, r in enumerate(refs)}
            held.sort(key=lambda r: order[r.uid])
            yield held, busy
        finally:
            for uid in locks:
                self._locks[uid].release()
                self._drop(uid)

    def _drop(self, uid: str) -> None:
        users = self._users[uid] - 1
        if users:
            self._users[uid] = users
        else:
            del self._users[uid], self._locks[uid]
