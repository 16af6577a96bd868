"""The NVML backend: real GPUs through NVIDIA's ``nvidia-ml-py`` binding (module ``pynvml``).

This is the only module that imports ``pynvml``, and only inside :meth:`NvmlBackend.open`,
so the agent imports and runs on nodes without the driver. Tests inject a fake module with
the same functions (``nvml=``).

The backend never fails because the driver is not there (yet): ``load`` finds
``libnvidia-ml.so.1`` under ``paths.driver_root`` (:mod:`agent.backends.nvml.library`),
initialises NVML, and answers an empty inventory with the reason while either step fails.
Every ``load`` tries again, so a node whose driver container becomes ready minutes after the
agent started moves from "no GPUs" to its GPUs at the next inventory refresh. Whether that
waiting makes the agent unready is :meth:`NvmlBackend.readiness`'s answer: only for
``--backend nvml`` (``required``), never for ``auto``.

Every NVML call runs off the event loop: ``load`` and each periodic check in
``asyncio.to_thread``, the blocking event wait in one dedicated thread
(:class:`~agent.backends.nvml.events.EventWatcher`, one per backend), and each utilization
reading in a daemon thread of its own (:mod:`agent.backends.nvml.sample`).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import structlog

from agent.backends.backend import SignalSink
from agent.backends.mps import MpsSupervisor
from agent.backends.nvml import library as nvml_library
from agent.backends.nvml.errors import describe, translate_init
from agent.backends.nvml.events import BLIND_AFTER_S, EventWatcher
from agent.backends.nvml.health import InFlight, run_checks
from agent.backends.nvml.inventory import InventoryReader, Reading
from agent.backends.nvml.mig import NvmlMig
from agent.backends.nvml.sample import in_daemon_thread, read_samples
from agent.base.errors import BackendError, LibraryMissingError
from agent.core.config.schema import HealthConfig
from agent.core.inventory.model import Inventory
from agent.core.inventory.sample import DeviceSample
from agent.core.partitioning import MigControl, MpsControl, NoMps

#: how long close() waits for NVML calls still running in worker threads
CLOSE_WAIT_S = 2.0
log = structlog.get_logger("agent.nvml")

_MODULE = "pynvml"


def import_binding() -> ModuleType:
    """The installed NVML binding; LibraryMissingError (one line) when it is not installed."""
    try:
        return importlib.import_module(_MODULE)
    except ImportError as exc:
        raise LibraryMissingError(
            "the NVML Python binding is not installed (package nvidia-ml-py, module pynvml)"
        ) from exc


def _monitoring_with(interval_s: float, config: HealthConfig) -> bool:
    return config.enabled and config.check_interval_s == interval_s


class NvmlBackend:
    """The :class:`~agent.backends.backend.Backend` for real NVIDIA GPUs.

    ``driver_root``: where the agent sees the driver's files (``paths.driver_root``).
    ``required``: the operator asked for NVML (``--backend nvml``), so waiting for it makes
    the agent unready; with ``auto`` a node without NVML is simply a node without GPUs.
    ``wait_for_driver``: False for one-shot commands (``gpu-agent inventory``): a required
    NVML that cannot be loaded makes ``open`` raise its one-line error instead of waiting.
    ``mps_dir``: where MPS daemons' pipe and log directories go; without one, no MPS.
    """

    name = "nvml"

    def __init__(
        self,
        *,
        health: HealthConfig,
        driver_root: Path = Path("/"),
        required: bool = False,
        wait_for_driver: bool = True,
        nvml: ModuleType | None = None,
        sysfs_root: Path = Path("/sys"),
        procfs_root: Path = Path("/proc"),
        blind_after_s: float = BLIND_AFTER_S,
        mps_dir: Path | None = None,
    ) -> None:
        self._health = health
        self._driver_root = driver_root
        self._required = required
        self._wait_for_driver = wait_for_driver
        self._nvml = nvml
        self._sysfs_root = sysfs_root
        self._procfs_root = procfs_root
        self._blind_after_s = blind_after_s
        self._opened = False
        self._initialised = False
        self._closed = False
        self._init_lock = asyncio.Lock()
        # what status() shows about getting NVML going
        self._attempts = 0
        self._library: str | None = None
        self._searched = ""
        self._last_error: str | None = None
        self._last_exc: BackendError | None = None
        self._reading: Reading | None = None
        # GPUs already logged as supporting fewer event types, across watches
        self._reduced_logged: set[str] = set()
        self._in_flight = InFlight()
        # the one event thread, shared by overlapping watches; guarded by _events_lock
        self._events: EventWatcher | None = None
        self._followers = 0
        self._events_lock = asyncio.Lock()
        self._stray_threads: list[EventWatcher] = []
        self._health_changed = asyncio.Event()
        self._mig = NvmlMig(
            module=self._module,
            reading=lambda: self._reading,
            reader=self._reader,
            procfs_root=procfs_root,
            in_flight=self._in_flight,
        )
        self._mps = MpsSupervisor(driver_root=driver_root, base_dir=mps_dir) if mps_dir is not None else None
        self.mig: MigControl = self._mig
        self.mps: MpsControl = self._mps or NoMps("MPS needs a state directory (none given)")

    # --- lifecycle ------------------------------------------------------------------

    async def open(self) -> None:
        """Import the binding (LibraryMissingError when it is not installed) and try NVML once.

        A missing driver is not an error here: ``load`` keeps trying.
        """
        self._closed = False
        if self._nvml is None:
            self._nvml = import_binding()
        self._opened = True
        if not await self._ensure_initialised() and self._required and not self._wait_for_driver:
            raise self._last_exc or BackendError(self._last_error or "NVML not available")

    def _module(self) -> ModuleType:
        if self._nvml is None or not self._opened:
            raise BackendError("the NVML backend is not open")
        return self._nvml

    async def _ensure_initialised(self) -> bool:
        """Find and load the library, then nvmlInit; False (status says why) when it cannot yet."""
        if self._initialised:
            return True
        async with self._init_lock:
            if self._initialised or self._closed:
                return self._initialised
            nvml = self._module()
            self._attempts += 1
            try:
                await asyncio.to_thread(self._init_blocking, nvml)
            except BackendError as exc:
                self._last_exc = exc
                self._waiting(str(exc))
                return False
            self._initialised = True
            self._last_error = None
            log.info("NVML initialised", library=self._library or "the binding's default")
            return True

    def _init_blocking(self, nvml: ModuleType) -> None:
        choice = nvml_library.locate(self._driver_root)
        self._searched = choice.searched
        if choice.path is not None and not nvml_library.loaded(nvml):
            try:
                nvml_library.bind(nvml, choice.path)
            except OSError as exc:
                raise LibraryMissingError(f"cannot load {choice.path}: {exc}") from exc
            except nvml_library.BindingUnsupported as exc:
                raise BackendError(str(exc)) from exc
            self._library = str(choice.path)
        try:
            nvml.nvmlInit()
        except Exception as exc:
            error = translate_init(nvml, exc)
            if isinstance(error, LibraryMissingError):
                raise LibraryMissingError(f"NVML not loaded: {choice.searched}") from exc
            raise error from exc

    def _waiting(self, error: str) -> None:
        if error != self._last_error and self._wait_for_driver:
            logger = log.warning if self._required else log.info
            logger("NVML not available; will try again at the next inventory refresh", reason=error)
        self._last_error = error

    async def close(self) -> None:
        """Stop the event thread and shut NVML down once; idempotent and safe when ``open`` failed.

        MPS daemons stop being watched but keep running for their clients."""
        self._closed = True
        await self._mig.close()
        if self._mps is not None:
            await self._mps.close()
        async with self._events_lock:
            if self._events is not None:
                await self._retire(self._events)
                self._events = None
        if not self._initialised or self._nvml is None:
            return
        self._initialised = False
        nvml = self._nvml
        idle = await asyncio.to_thread(self._in_flight.wait_idle, CLOSE_WAIT_S)
        if not idle or any(w.alive for w in self._stray_threads):
            # pulling NVML from under a running call can crash the process; exit releases it
            log.warning("NVML left initialised: a call or the event thread is still inside NVML")
            return
        try:
            await asyncio.to_thread(nvml.nvmlShutdown)
        except Exception as exc:
            log.warning("NVML shutdown failed", error=describe(nvml, exc))
        else:
            log.info("NVML shut down")

    # --- inventory ------------------------------------------------------------------

    async def load(self) -> Inventory:
        """The node's GPUs (one worker thread); an empty inventory with the reason while NVML is not there.

        A GPU that cannot be read is left out and listed in ``Inventory.problems``. Raises
        BackendError only when NVML answers but the node-wide queries fail after a first
        good read (the caller keeps its last inventory); before that, the failure becomes
        the empty inventory's reason.
        """
        if not await self._ensure_initialised():
            return Inventory.empty(self.name, reason=self._last_error or "NVML not available")
        reader = self._reader(previous=self._reading)
        try:
            reading = await asyncio.to_thread(self._in_flight.call, reader.read)
        except BackendError as exc:
            self._last_error = str(exc)
            if self._reading is None:
                log.warning("NVML inventory read failed", error=str(exc))
                return Inventory.empty(self.name, reason=str(exc))
            raise
        self._last_error = None
        inventory = reading.inventory
        if self._reading is None or inventory != self._reading.inventory:
            log.info(
                "NVML inventory loaded",
                gpus=len(inventory.gpus),
                driver=inventory.driver_version,
                cuda=inventory.cuda_driver_version,
                problems=list(inventory.problems),
            )
        self._reading = reading
        return inventory

    def _reader(self, previous: Reading | None = None) -> InventoryReader:
        return InventoryReader(
            self._module(),
            backend=self.name,
            sysfs_root=self._sysfs_root,
            procfs_root=self._procfs_root,
            previous=previous,
        )

    def _handles(self) -> dict[str, Any]:
        return dict(self._reading.handles) if self._reading is not None else {}

    # --- utilization ------------------------------------------------------------------

    async def sample(self, inventory: Inventory, *, busy: frozenset[str]) -> dict[str, DeviceSample]:
        """One reading of every device, in a daemon thread of its own (a hung call ties up only it).

        Nothing while NVML is not initialised. The call is counted in flight, so ``close`` never
        shuts NVML down under it.
        """
        if not self._initialised or self._closed:
            return {}
        nvml, handles = self._module(), self._handles()
        return await in_daemon_thread(
            self._in_flight.call, read_samples, nvml, inventory, handles, name="nvml-utilization"
        )

    # --- health ---------------------------------------------------------------------

    def update_health_config(self, config: HealthConfig) -> None:
        """Apply a new health config live: enabled, check interval and event wait bound.

        Call on the loop thread. Running watches start or stop monitoring at once and restart
        their checks when the interval changes; the event wait bound applies from the next wait.
        """
        self._health = config
        changed, self._health_changed = self._health_changed, asyncio.Event()
        changed.set()

    async def _until_not(self, holds: Callable[[HealthConfig], bool]) -> None:
        """Return once the health config no longer satisfies ``holds``."""
        while True:
            changed = self._health_changed
            if not holds(self._health):
                return
            await changed.wait()

    async def watch_health(self, inventory: Inventory, emit: SignalSink) -> None:
        """Xid/ECC events plus per-GPU periodic checks for ``inventory``, until cancelled.

        Idles while there are no GPUs (a new inventory gets a new watch) and while health is
        disabled, and follows ``update_health_config`` live.
        """
        if not inventory.gpus:
            await asyncio.get_running_loop().create_future()
        while True:
            await self._until_not(lambda c: not c.enabled)
            interval = self._health.check_interval_s
            async with asyncio.TaskGroup() as group:
                monitor = group.create_task(self._monitor(inventory, emit), name="nvml-monitor")
                await self._until_not(partial(_monitoring_with, interval))
                monitor.cancel()

    async def _monitor(self, inventory: Inventory, emit: SignalSink) -> None:
        nvml = self._module()
        handles = self._handles()
        token = await self._follow(inventory, handles, emit)
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._guard_events(), name="nvml-events")
                for gpu in inventory.gpus:
                    group.create_task(
                        run_checks(
                            nvml,
                            gpu,
                            interval_s=self._health.check_interval_s,
                            emit=emit,
                            handle=handles.get(gpu.uuid),
                            in_flight=self._in_flight,
                        ),
                        name=f"nvml-check-{gpu.index}",
                    )
        finally:
            await self._unfollow(token)

    async def _follow(self, inventory: Inventory, handles: dict[str, Any], emit: SignalSink) -> int:
        async with self._events_lock:
            if self._events is None or not self._events.alive:
                events = EventWatcher(
                    nvml=self._module(),
                    wait_ms=lambda: self._health.event_wait_ms,
                    loop=asyncio.get_running_loop(),
                    blind_after_s=self._blind_after_s,
                    reduced_logged=self._reduced_logged,
                )
                token = events.follow(inventory, handles, emit)  # before start: the first set has every GPU
                events.start()
                self._events, self._followers = events, 1
                return token
            self._followers += 1
            return self._events.follow(inventory, handles, emit)

    async def _unfollow(self, token: int) -> None:
        # shielded: a cancelled watch must still leave the shared thread consistent
        await asyncio.shield(self._unfollow_now(token))

    async def _unfollow_now(self, token: int) -> None:
        async with self._events_lock:
            events = self._events
            if events is None:
                return
            events.unfollow(token)
            self._followers -= 1
            if self._followers <= 0:
                self._events = None
                await self._retire(events)

    async def _retire(self, events: EventWatcher) -> None:
        await events.stop()
        if events.alive:
            self._stray_threads.append(events)

    async def _guard_events(self) -> None:
        events = self._events
        if events is None:
            return
        await events.wait_exited()
        if not events.thread.is_alive() and self._events is events:
            log.warning("NVML event thread ended early; only periodic checks report health")
        await asyncio.get_running_loop().create_future()

    # --- views ----------------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        """(ready, detail) for /readyz: waiting for NVML fails readiness only when NVML is required."""
        if self._initialised:
            return True, f"NVML loaded from {self._library or 'the loader path'}"
        detail = f"waiting for NVML: {self._last_error or 'not tried yet'}"
        return (not self._required), detail

    def status(self) -> dict[str, object]:
        """What /debug/state shows about the backend."""
        events = self._events
        inventory = self._reading.inventory if self._reading is not None else None
        return {
            "backend": self.name,
            "required": self._required,
            "state": "ready" if self._initialised else "closed" if self._closed else "waiting",
            "driver_root": str(self._driver_root),
            "library": self._library,
            "library_search": self._searched,
            "init_attempts": self._attempts,
            "last_error": self._last_error,
            "problems": list(inventory.problems) if inventory is not None else [],
            "health": {
                "enabled": self._health.enabled,
                "check_interval_s": self._health.check_interval_s,
                "event_wait_ms": self._health.event_wait_ms,
            },
            "events": events.status() if events is not None else {"running": False},
            "mig": self._mig.status(),
        }
