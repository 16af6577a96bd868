"""Device health as the kubelet's DRA health stream wants it: the complete list, kept fresh.

The kubelet (gate ``ResourceHealthStatus``) opens ``NodeWatchResources`` after registration
and marks a device *Unknown* when no report for it arrived within its timeout (30 s fixed
in 1.34; per device from 1.35, ``health_check_timeout_seconds``). So every stream gets the
complete list of this driver's devices (the DRA-owned ones of this node, named as in the
ResourceSlices) when it opens, again whenever that list or a device's health changes, and
again every ``resend_s`` (10 s) even when nothing changed; each report says its timeout is
``timeout_s`` (45 s), four and a half resend periods.

The waiting is injectable (``sleep``) so tests drive the resend without waiting for real.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

from agent.base.feeds import Broadcast
from agent.core.config.schema import Owner
from agent.core.health.model import HealthState
from agent.core.node import NodeFacts
from agent.dra.devices import DraDevice
from agent.dra.modes import ModeGate

RESEND_S = 10.0
TIMEOUT_S = 45
MAX_STREAMS = 4
#: the kubelet cuts longer messages
MAX_MESSAGE = 1024


class TooManyStreams(Exception):
    """More health streams than a kubelet ever needs are open."""


@dataclass(frozen=True, slots=True)
class DeviceHealthReport:
    pool: str
    device: str
    state: HealthState
    #: Unix seconds
    updated: int
    timeout_s: int
    message: str = ""


class HealthFeed:
    def __init__(
        self,
        *,
        pool: str,
        node: NodeFacts,
        resend_s: float = RESEND_S,
        timeout_s: int = TIMEOUT_S,
        max_streams: int = MAX_STREAMS,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        gate: ModeGate | None = None,
        health_uuid: Callable[[DraDevice], str] = lambda device: device.uuid,
    ) -> None:
        self.pool = pool
        self._gate = gate or ModeGate(inventory=node.inventory)
        self._health_uuid = health_uuid
        self._inventory = node.inventory
        self._ownership = node.ownership
        self._health = node.health
        self.resend_s = resend_s
        self.timeout_s = timeout_s
        self._max_streams = max_streams
        self._wall = wall
        self._sleep = sleep
        #: fires when the device list or any health may have changed (fed by :meth:`run`)
        self.changes: Broadcast[None] = Broadcast(maxsize=1)
        self.streams = 0
        self.messages_sent = 0

    def snapshot(self) -> list[DeviceHealthReport]:
        """Every DRA-owned device of this node (as its GPU's shape publishes it) with its health now;
        a partition whose MIG instance exists reports the instance's health, else its GPU's."""
        table = self._ownership.current
        now = int(self._wall())
        out = []
        for device in self._gate.devices():
            if not table.granted_to(device.uuid, Owner.DRA):
                continue
            uuid = self._health_uuid(device)
            state = self._health.state(uuid)
            out.append(
                DeviceHealthReport(
                    pool=self.pool,
                    device=device.name,
                    state=state,
                    updated=now,
                    timeout_s=self.timeout_s,
                    message=self._message(uuid, state),
                )
            )
        return out

    def _message(self, uuid: str, state: HealthState) -> str:
        if state is HealthState.HEALTHY:
            return ""
        if state is HealthState.UNKNOWN:
            return "the agent's health monitor does not track this device"
        record = self._health.record(uuid)
        cause = record.cause if record is not None and record.cause else "unhealthy"
        if record is not None and record.reset_required:
            cause += " (needs a GPU reset)"
        return cause[:MAX_MESSAGE]

    async def run(self) -> None:
        """Turn inventory, ownership and health changes into :attr:`changes`; until cancelled."""
        with (
            self._health.changes.subscribe() as health,
            self._ownership.changes.subscribe() as ownership,
            self._inventory.changes.subscribe() as inventory,
            self._gate.changes.subscribe() as shapes,
        ):
            async with asyncio.TaskGroup() as tg:
                feeds = (("health", health), ("ownership", ownership), ("inventory", inventory), ("shapes", shapes))
                for name, sub in feeds:
                    tg.create_task(self._forward(sub), name=f"dra-health-feed-{name}")

    async def _forward(self, subscription: AsyncIterator[object]) -> None:
        async for _ in subscription:
            self.changes.publish(None)

    @contextlib.contextmanager
    def stream(self) -> Iterator[AsyncIterator[list[DeviceHealthReport]]]:
        """One stream's reports; TooManyStreams when ``max_streams`` are open already."""
        if self.streams >= self._max_streams:
            raise TooManyStreams(f"{self.streams} health streams are open already (at most {self._max_streams})")
        self.streams += 1
        try:
            with self.changes.subscribe() as changes:
                yield self._reports(changes)
        finally:
            self.streams -= 1

    async def _reports(self, changes: AsyncIterator[None]) -> AsyncIterator[list[DeviceHealthReport]]:
        last: list[tuple[str, HealthState, str]] | None = None
        resend = True
        while True:
            reports = self.snapshot()
            key = [(r.device, r.state, r.message) for r in reports]
            if resend or key != last:
                self.messages_sent += 1
                yield reports
                last = key
            resend = await self._wait(changes)

    async def _wait(self, changes: AsyncIterator[None]) -> bool:
        """Wait for a change or the resend period; True when the period ran out (resend)."""
        change = asyncio.ensure_future(anext(changes))
        timer = asyncio.ensure_future(self._sleep(self.resend_s))
        try:
            await asyncio.wait({change, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (change, timer):
                task.cancel()  # a no-op on the one that finished
            await asyncio.gather(change, timer, return_exceptions=True)
        return timer.done() and not timer.cancelled() and timer.exception() is None
