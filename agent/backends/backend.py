"""The interface every device backend implements, and the null backend for GPU-less nodes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from agent.core.config.schema import HealthConfig
from agent.core.health.model import Signal
from agent.core.inventory.model import Inventory
from agent.core.inventory.sample import DeviceSample
from agent.core.partitioning import MigControl, MpsControl, NoMig, NoMps

#: Health sources call this from the event loop thread (thread-based sources hop to the
#: loop with ``loop.call_soon_threadsafe`` first).
SignalSink = Callable[[Signal], None]


class Backend(Protocol):
    """A source of devices and of raw health signals.

    Lifecycle: ``open`` once, then ``load`` and ``sample`` any number of times, ``watch_health``
    as a task that runs until cancelled, and ``close`` (idempotent, also safe when ``open`` failed).
    ``load`` may answer an empty inventory (with ``Inventory.reason``) and later the node's
    GPUs: a backend that waits for its driver keeps trying on every ``load``.

    ``mig`` and ``mps`` carve GPUs at run time (:mod:`agent.core.partitioning`); a backend that
    cannot has ``NoMig`` / ``NoMps``. MIG instances made or destroyed show in the next ``load``.
    """

    name: str

    @property
    def mig(self) -> MigControl: ...

    @property
    def mps(self) -> MpsControl: ...

    async def open(self) -> None: ...

    async def load(self) -> Inventory: ...

    async def watch_health(self, inventory: Inventory, emit: SignalSink) -> None:
        """Report signals for the devices in ``inventory`` until cancelled.

        Must emit ``CHECK_OK`` for each device that passes its periodic check so that the
        monitor can recover devices; must never block the event loop. Follows
        :meth:`update_health_config` while it runs.
        """
        ...

    def update_health_config(self, config: HealthConfig) -> None:
        """A new ``health`` config section (live reload); call on the loop thread."""
        ...

    async def sample(self, inventory: Inventory, *, busy: frozenset[str]) -> dict[str, DeviceSample]:
        """Utilization and memory of the devices of ``inventory`` (GPUs and MIG devices), by UUID.

        A device that cannot be read is left out (the caller shows it as unknown). Never blocks
        the event loop, but may take as long as the hardware does, or never return: the caller
        bounds the wait, never starts a second sample while one is running, and abandons one
        that hangs (so a hung read must tie up nothing but its own thread). ``busy`` names the
        physical GPUs something holds; a backend that measures ignores it, the simulated one
        makes held GPUs look busy.
        """
        ...

    def readiness(self) -> tuple[bool, str]:
        """(ready, one-line detail) for /readyz: False only when the backend cannot serve as asked."""
        ...

    def status(self) -> dict[str, object]:
        """JSON-ready facts for /debug/state (what was tried, what was found, the last error)."""
        ...

    async def close(self) -> None: ...


class NullBackend:
    """No GPUs on this node: an empty inventory and no health signals, forever."""

    name = "none"

    def __init__(self, reason: str = "no GPUs found") -> None:
        self.reason = reason
        self.mig: MigControl = NoMig(f"no GPUs on this node: {reason}")
        self.mps: MpsControl = NoMps(f"no GPUs on this node: {reason}")

    async def open(self) -> None:
        return None

    async def load(self) -> Inventory:
        return Inventory.empty(self.name, reason=self.reason)

    async def watch_health(self, inventory: Inventory, emit: SignalSink) -> None:
        await asyncio.Event().wait()

    def update_health_config(self, config: HealthConfig) -> None:
        return None

    async def sample(self, inventory: Inventory, *, busy: frozenset[str]) -> dict[str, DeviceSample]:
        return {}

    def readiness(self) -> tuple[bool, str]:
        return True, self.reason

    def status(self) -> dict[str, object]:
        return {"backend": self.name, "reason": self.reason}

    async def close(self) -> None:
        return None
