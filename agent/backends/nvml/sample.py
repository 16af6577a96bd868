"""Utilization and memory readings from NVML, and the thread a reading runs in.

:func:`read_samples` asks each GPU through its own handle (read at inventory time; see
:mod:`agent.backends.nvml.health` for why never by UUID) for ``nvmlDeviceGetUtilizationRates``
and ``nvmlDeviceGetMemoryInfo``, and each MIG device (through its parent's handle and its slot)
for its memory. A device whose query fails is left out of the answer, so it reads as unknown;
a query the device does not support (utilization in MIG mode, memory of an integrated GPU)
is ``None`` in an otherwise good reading.

A reading runs in a daemon thread of its own (:func:`in_daemon_thread`), not in the loop's
executor: an NVML call that hangs forever then holds one thread that nobody waits for, neither
the executor's workers (health checks, CDI writes) nor the interpreter's exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Mapping
from functools import partial
from types import ModuleType
from typing import Any, TypeVar

import structlog

from agent.backends.nvml.errors import describe, optional_call
from agent.core.inventory.model import Inventory
from agent.core.inventory.sample import DeviceSample, mib

T = TypeVar("T")
log = structlog.get_logger("agent.nvml")


def read_samples(nvml: ModuleType, inventory: Inventory, handles: Mapping[str, Any]) -> dict[str, DeviceSample]:
    """One reading of every device of ``inventory`` that has a handle. Blocking: call off the loop."""
    out: dict[str, DeviceSample] = {}
    for gpu in inventory.gpus:
        handle = handles.get(gpu.uuid)
        if handle is None:
            continue  # not read through this backend's inventory: no handle of its own to ask
        if not _read(nvml, gpu.uuid, out, partial(_gpu_sample, nvml, gpu.uuid, handle)):
            continue  # the GPU does not answer: its MIG devices would not either
        for mig in gpu.mig_devices:
            _read(nvml, mig.uuid, out, partial(_mig_sample, nvml, mig.uuid, handle, mig.index))
    return out


def _read(nvml: ModuleType, uuid: str, out: dict[str, DeviceSample], read: Callable[[], DeviceSample]) -> bool:
    try:
        out[uuid] = read()
    except nvml.NVMLError as exc:
        log.debug("utilization not read", uuid=uuid, error=describe(nvml, exc))
        return False
    except Exception as exc:  # a binding that answers with the wrong types: this device is unknown
        log.debug("utilization not read", uuid=uuid, error=f"{type(exc).__name__}: {exc}")
        return False
    return True


def _gpu_sample(nvml: ModuleType, uuid: str, handle: Any) -> DeviceSample:
    rates = optional_call(nvml, getattr(nvml, "nvmlDeviceGetUtilizationRates", None), handle)
    memory = optional_call(nvml, getattr(nvml, "nvmlDeviceGetMemoryInfo", None), handle)
    return DeviceSample(
        uuid=uuid,
        gpu_percent=float(rates.gpu) if rates is not None else None,
        memory_used_mib=mib(memory.used) if memory is not None else None,
        memory_total_mib=mib(memory.total) if memory is not None else None,
    )


def _mig_sample(nvml: ModuleType, uuid: str, parent: Any, slot: int) -> DeviceSample:
    memory = optional_call(
        nvml, getattr(nvml, "nvmlDeviceGetMemoryInfo", None), nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, slot)
    )
    return DeviceSample(
        uuid=uuid,
        memory_used_mib=mib(memory.used) if memory is not None else None,
        memory_total_mib=mib(memory.total) if memory is not None else None,
    )


async def in_daemon_thread(fn: Callable[..., T], *args: object, name: str) -> T:
    """Run ``fn(*args)`` in a new daemon thread and wait for it.

    Cancelling the wait abandons the thread (it finishes or hangs on its own); its result is
    then dropped. Use it for calls that may never return.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def deliver(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the waiting coroutine, whatever it is
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(deliver, result, error)

    threading.Thread(target=work, name=name, daemon=True).start()
    return await future
