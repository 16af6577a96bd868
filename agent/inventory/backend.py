"""The interface every device backend implements, and the null backend for GPU-less nodes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from agent.health.model import Signal
from agent.inventory.model import Inventory

#: Health sources call this from the event loop thread (thread-based sources hop to the
#: loop with ``loop.call_soon_threadsafe`` first).
SignalSink = Callable[[Signal], None]


class Backend(Protocol):
    """A source of devices and of raw health signals.

    Lifecycle: ``open`` once, then ``load`` any number of times, ``watch_health`` as a task
    that runs until cancelled, and ``close`` (idempotent, also safe when ``open`` failed).
    """

    name: str

    async def open(self) -> None: ...

    async def load(self) -> Inventory: ...

    async def watch_health(self, inventory: Inventory, emit: SignalSink) -> None:
        """Report signals for the devices in ``inventory`` until cancelled.

        Must emit ``CHECK_OK`` for each device that passes its periodic check so that the
        monitor can recover devices; must never block the event loop.
        """
        ...

    async def close(self) -> None: ...


class NullBackend:
    """No GPUs on this node: an empty inventory and no health signals, forever."""

    name = "none"

    def __init__(self, reason: str = "no GPUs found") -> None:
        self.reason = reason

    async def open(self) -> None:
        return None

    async def load(self) -> Inventory:
        return Inventory.empty(self.name)

    async def watch_health(self, inventory: Inventory, emit: SignalSink) -> None:
        await asyncio.Event().wait()

    async def close(self) -> None:
        return None
