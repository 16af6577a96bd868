"""The NVML backend: real GPUs through NVIDIA's ``nvidia-ml-py`` binding (module ``pynvml``).

This is the only module that imports ``pynvml``, and only inside :meth:`NvmlBackend.open`
and :func:`nvml_available`, so the agent imports and runs on nodes without the driver.
Tests inject a fake module with the same functions (``nvml=``).

Every NVML call runs off the event loop: ``load`` and each periodic check in
``asyncio.to_thread``, the blocking event wait in one dedicated thread
(:class:`~agent.inventory.nvml_health.EventWatcher`). NVML errors become the typed,
one-line errors of :mod:`agent.errors`.
"""

from __future__ import annotations

import asyncio
import importlib
from pathlib import Path
from types import ModuleType

import structlog

from agent.config.schema import HealthConfig
from agent.errors import BackendError, LibraryMissingError
from agent.inventory.backend import SignalSink
from agent.inventory.model import Inventory
from agent.inventory.nvml_errors import describe, translate_init
from agent.inventory.nvml_health import EventWatcher, InFlight, run_checks
from agent.inventory.nvml_inventory import InventoryReader

#: how long close() waits for NVML calls still running in worker threads
CLOSE_WAIT_S = 2.0
log = structlog.get_logger("agent.nvml")

_MODULE = "pynvml"


def _import_nvml() -> ModuleType:
    try:
        return importlib.import_module(_MODULE)
    except ImportError as exc:
        raise LibraryMissingError(
            "the NVML Python binding is not installed (package nvidia-ml-py, module pynvml)"
        ) from exc


async def nvml_available(nvml: ModuleType | None = None) -> bool:
    """Whether NVML initialises and sees at least one GPU (``--backend auto``).

    Never raises for a missing library or a failed init; shuts NVML down again.
    """
    try:
        module = nvml if nvml is not None else _import_nvml()
    except LibraryMissingError as exc:
        log.info("NVML not available", reason=str(exc))
        return False
    try:
        await asyncio.to_thread(module.nvmlInit)
    except Exception as exc:
        log.info("NVML not available", reason=str(translate_init(module, exc)))
        return False
    try:
        count = int(await asyncio.to_thread(module.nvmlDeviceGetCount))
    except Exception as exc:
        log.info("NVML initialised but counting GPUs failed", error=describe(module, exc))
        count = 0
    finally:
        try:
            await asyncio.to_thread(module.nvmlShutdown)
        except Exception as exc:
            log.warning("NVML shutdown after the availability probe failed", error=describe(module, exc))
    return count >= 1


class NvmlBackend:
    """The :class:`~agent.inventory.backend.Backend` for real NVIDIA GPUs."""

    name = "nvml"

    def __init__(
        self,
        *,
        health: HealthConfig,
        nvml: ModuleType | None = None,
        sysfs_root: Path = Path("/sys"),
        procfs_root: Path = Path("/proc"),
    ) -> None:
        self._health = health
        self._nvml = nvml
        self._sysfs_root = sysfs_root
        self._procfs_root = procfs_root
        self._initialised = False
        # GPUs already logged as supporting fewer event types, across watch_health runs
        self._reduced_logged: set[str] = set()
        self._in_flight = InFlight()
        self._watchers: set[EventWatcher] = set()

    async def open(self) -> None:
        """Load the binding and initialise NVML; LibraryMissingError or BackendInitError on failure."""
        if self._initialised:
            return
        if self._nvml is None:
            self._nvml = _import_nvml()
        nvml = self._nvml
        try:
            await asyncio.to_thread(nvml.nvmlInit)
        except Exception as exc:
            raise translate_init(nvml, exc) from exc
        self._initialised = True
        log.info("NVML initialised")

    def _module(self) -> ModuleType:
        if not self._initialised or self._nvml is None:
            raise BackendError("the NVML backend is not open")
        return self._nvml

    async def load(self) -> Inventory:
        """Read every GPU, its MIG devices and the topology (one worker thread)."""
        reader = InventoryReader(
            self._module(), backend=self.name, sysfs_root=self._sysfs_root, procfs_root=self._procfs_root
        )
        inventory = await asyncio.to_thread(self._in_flight.call, reader.read)
        log.info(
            "NVML inventory loaded",
            gpus=len(inventory.gpus),
            driver=inventory.driver_version,
            cuda=inventory.cuda_driver_version,
        )
        return inventory

    async def watch_health(self, inventory: Inventory, emit: SignalSink) -> None:
        """Xid/ECC events from the event thread plus per-GPU periodic checks, until cancelled."""
        if not self._health.enabled or not inventory.gpus:
            await asyncio.get_running_loop().create_future()  # wait until cancelled
            return
        nvml = self._module()
        watcher = EventWatcher(
            nvml=nvml,
            inventory=inventory,
            wait_ms=self._health.event_wait_ms,
            emit=emit,
            loop=asyncio.get_running_loop(),
            reduced_logged=self._reduced_logged,
        )
        watcher.start()
        self._watchers.add(watcher)
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._guard_events(watcher), name="nvml-events")
                for gpu in inventory.gpus:
                    group.create_task(
                        run_checks(
                            nvml, gpu, interval_s=self._health.check_interval_s, emit=emit, in_flight=self._in_flight
                        ),
                        name=f"nvml-check-{gpu.index}",
                    )
        finally:
            await watcher.stop()
            if not watcher.alive:
                self._watchers.discard(watcher)

    @staticmethod
    async def _guard_events(watcher: EventWatcher) -> None:
        await watcher.wait_exited()
        log.warning("NVML event thread ended early; only periodic checks report health")
        await asyncio.get_running_loop().create_future()

    async def close(self) -> None:
        """Shut NVML down once; idempotent and safe when ``open`` failed."""
        if not self._initialised or self._nvml is None:
            return
        self._initialised = False
        nvml = self._nvml
        idle = await asyncio.to_thread(self._in_flight.wait_idle, CLOSE_WAIT_S)
        if not idle or any(w.alive for w in self._watchers):
            # pulling NVML from under a running call can crash the process; exit releases it
            log.warning("NVML left initialised: a call or the event thread is still inside NVML")
            return
        try:
            await asyncio.to_thread(nvml.nvmlShutdown)
        except Exception as exc:
            log.warning("NVML shutdown failed", error=describe(nvml, exc))
        else:
            log.info("NVML shut down")
