"""NVML health sources: the periodic per-GPU check and the event thread (Xid, ECC).

Both only *report* :class:`Signal` s; what a signal means (an application Xid that is
ignored, a fatal one) is the health policy's business, not ours.

Every question about one GPU goes through that GPU's own handle, read at inventory time:
``nvmlDeviceGetHandleByUUID`` answers ``GPU_IS_LOST`` when *any* GPU of the node has
fallen off the bus (documented in ``nvml.h``), so looking a GPU up by UUID would report
every GPU lost after one Xid 79.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

import structlog

from agent.backends.backend import SignalSink
from agent.backends.nvml.errors import (
    ERROR_GPU_IS_LOST,
    ERROR_INVALID_ARGUMENT,
    ERROR_NOT_FOUND,
    describe,
    nvml_code,
    optional_call,
)
from agent.backends.nvml.inventory import text
from agent.core.health.model import Signal, SignalKind
from agent.core.inventory.model import Gpu

T = TypeVar("T")
log = structlog.get_logger("agent.nvml")

# --- the periodic check -----------------------------------------------------------------

#: "NVML answers garbage" thresholds. Deliberately loose: a GARBAGE signal takes the GPU out
#: of service, so only values no working GPU can report count.
MAX_PLAUSIBLE_MEMORY_BYTES = 64 * 1024**4  # 64 TiB; today's largest GPUs have < 300 GiB
MAX_PLAUSIBLE_TEMPERATURE_C = 200


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One periodic check of one GPU: the signal to emit (None: inconclusive) and why."""

    signal: Signal | None
    outcome: str  # stable text for "did the outcome change" logging


def check_gpu(nvml: ModuleType, gpu: Gpu, handle: Any = None) -> CheckResult:
    """Ask NVML about one GPU through its own handle. Blocking: call from a worker thread.

    Rules, in order:

    * ``GPU_IS_LOST`` from a call on the GPU's own handle -> ``LOST``. Without a handle (an
      inventory the backend did not read) the GPU is looked up by UUID; that lookup's
      ``GPU_IS_LOST`` may be about another GPU, so it is confirmed on the handle by index
      (whose UUID must match) before anything is reported; NOT_FOUND / INVALID_ARGUMENT
      from the lookup -> ``LOST``.
    * ``GARBAGE`` when NVML answers with values that cannot be right: the UUID read back
      from the handle differs; total memory is 0 or above 64 TiB; used memory exceeds
      total; the GPU temperature is above 200 C. A query the device does not support is
      skipped, never counted as garbage.
    * Any other NVML error makes the check inconclusive: nothing is emitted (so a device
      that is out of service does not recover on it, and a healthy one is not failed on a
      possibly transient error).
    * Otherwise ``CHECK_OK``.
    """
    uuid = gpu.uuid
    step = "reading its UUID"
    try:
        if handle is None:
            handle, result = _handle_by_uuid(nvml, gpu)
            if result is not None:
                return result
        seen = text(nvml.nvmlDeviceGetUUID(handle))
        if seen != uuid:
            return _garbage(uuid, f"UUID read back as {seen!r}")
        step = "reading memory info"
        memory = optional_call(nvml, nvml.nvmlDeviceGetMemoryInfo, handle)
        if memory is not None:
            total, used = int(memory.total), int(memory.used)
            if total <= 0 or total > MAX_PLAUSIBLE_MEMORY_BYTES:
                return _garbage(uuid, f"total memory {total} bytes")
            if used > total:
                return _garbage(uuid, f"used memory {used} bytes exceeds total {total} bytes")
        step = "reading its temperature"
        sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
        temperature = optional_call(nvml, nvml.nvmlDeviceGetTemperature, handle, sensor)
        if temperature is not None and int(temperature) > MAX_PLAUSIBLE_TEMPERATURE_C:
            return _garbage(uuid, f"temperature {int(temperature)} C")
    except nvml.NVMLError as exc:
        if nvml_code(nvml, exc) == ERROR_GPU_IS_LOST:
            return _lost(uuid, f"while {step}")
        return CheckResult(None, f"inconclusive: {step}: {describe(nvml, exc)}")
    return CheckResult(Signal(uuid=uuid, kind=SignalKind.CHECK_OK), "ok")


def _handle_by_uuid(nvml: ModuleType, gpu: Gpu) -> tuple[Any, CheckResult | None]:
    """(handle, None), or (None, the check's result) when the lookup itself decides it."""
    try:
        return nvml.nvmlDeviceGetHandleByUUID(gpu.uuid), None
    except nvml.NVMLError as exc:
        code = nvml_code(nvml, exc)
        if code in (ERROR_NOT_FOUND, ERROR_INVALID_ARGUMENT):
            return None, _lost(gpu.uuid, "NVML no longer finds it by UUID")
        if code != ERROR_GPU_IS_LOST:
            return None, CheckResult(None, f"inconclusive: looking up its handle: {describe(nvml, exc)}")
    # "some GPU is lost": ask this GPU through the handle of its index
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(gpu.index)
        if text(nvml.nvmlDeviceGetUUID(handle)) == gpu.uuid:
            return handle, None
    except nvml.NVMLError as exc:
        if nvml_code(nvml, exc) == ERROR_GPU_IS_LOST:
            return None, _lost(gpu.uuid, "while looking up its handle")
        return None, CheckResult(None, f"inconclusive: confirming by index: {describe(nvml, exc)}")
    return None, CheckResult(None, "inconclusive: another GPU is lost and its index now names a different GPU")


def _lost(uuid: str, detail: str) -> CheckResult:
    return CheckResult(Signal(uuid=uuid, kind=SignalKind.LOST, detail=detail), "lost")


def _garbage(uuid: str, detail: str) -> CheckResult:
    return CheckResult(Signal(uuid=uuid, kind=SignalKind.GARBAGE, detail=detail), f"garbage: {detail}")


class InFlight:
    """Counts NVML calls running in worker threads, so that NVML is never shut down under one.

    A cancelled ``asyncio.to_thread`` stops waiting, not the thread: the call may still be
    inside NVML when the backend closes.
    """

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()

    def call(self, fn: Callable[..., T], *args: object) -> T:
        with self._lock:
            self._count += 1
            self._idle.clear()
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._count -= 1
                if self._count == 0:
                    self._idle.set()

    def wait_idle(self, timeout_s: float) -> bool:
        """Block (in a worker thread) until no call is running; False on timeout."""
        return self._idle.wait(timeout_s)


async def run_checks(
    nvml: ModuleType,
    gpu: Gpu,
    *,
    interval_s: float,
    emit: SignalSink,
    handle: Any = None,
    in_flight: InFlight | None = None,
) -> None:
    """Check one GPU every ``interval_s`` seconds until cancelled; never raises otherwise.

    Each GPU has its own loop, so an NVML call that hangs on one GPU stalls only that GPU's
    checks. Logs when the outcome changes, not on every poll.
    """
    last = "ok"  # a first passing check is not news
    while True:
        try:
            if in_flight is None:
                result = await asyncio.to_thread(check_gpu, nvml, gpu, handle)
            else:
                result = await asyncio.to_thread(in_flight.call, check_gpu, nvml, gpu, handle)
        except Exception as exc:  # a bug or an unexpected binding error: keep checking
            result = CheckResult(None, f"inconclusive: check failed: {type(exc).__name__}: {exc}")
        if result.outcome != last:
            logger = log.info if result.outcome == "ok" else log.warning
            logger("periodic GPU check outcome changed", uuid=gpu.uuid, outcome=result.outcome, previous=last)
            last = result.outcome
        if result.signal is not None:
            try:
                emit(result.signal)
            except Exception:
                log.exception("health signal sink failed", uuid=gpu.uuid, kind=result.signal.kind.value)
        await asyncio.sleep(interval_s)
