"""NVML health sources: the event thread (Xid, ECC) and the periodic per-GPU check.

Both only *report* :class:`Signal` s; what a signal means (an application Xid that is
ignored, a fatal one) is the health policy's business, not ours.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

import structlog

from agent.health.model import Signal, SignalKind
from agent.inventory.backend import SignalSink
from agent.inventory.model import Gpu, Inventory
from agent.inventory.nvml_errors import (
    ERROR_GPU_IS_LOST,
    ERROR_INVALID_ARGUMENT,
    ERROR_NOT_FOUND,
    ERROR_TIMEOUT,
    NOT_SUPPORTED_CODES,
    describe,
    nvml_code,
)
from agent.inventory.nvml_inventory import text

T = TypeVar("T")
log = structlog.get_logger("agent.nvml")

#: gpuInstanceId / computeInstanceId of an event that is not about a MIG device
NO_INSTANCE = 0xFFFFFFFF
#: backoff after an unexpected event-wait error: doubles from MIN to MAX, reset by a good wait
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 5.0

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


def check_gpu(nvml: ModuleType, gpu: Gpu) -> CheckResult:
    """Re-read a GPU's handle and a few values. Blocking: call from a worker thread.

    Rules, in order:

    * ``GPU_IS_LOST`` from any call, or the UUID no longer resolving (NOT_FOUND /
      INVALID_ARGUMENT) -> ``LOST``.
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
    step = "looking up its handle"
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        step = "reading its UUID"
        seen = text(nvml.nvmlDeviceGetUUID(handle))
        if seen != uuid:
            return _garbage(uuid, f"UUID read back as {seen!r}")
        step = "reading memory info"
        memory = _optional(nvml, nvml.nvmlDeviceGetMemoryInfo, handle)
        if memory is not None:
            total, used = int(memory.total), int(memory.used)
            if total <= 0 or total > MAX_PLAUSIBLE_MEMORY_BYTES:
                return _garbage(uuid, f"total memory {total} bytes")
            if used > total:
                return _garbage(uuid, f"used memory {used} bytes exceeds total {total} bytes")
        step = "reading its temperature"
        sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
        temperature = _optional(nvml, nvml.nvmlDeviceGetTemperature, handle, sensor)
        if temperature is not None and int(temperature) > MAX_PLAUSIBLE_TEMPERATURE_C:
            return _garbage(uuid, f"temperature {int(temperature)} C")
    except nvml.NVMLError as exc:
        code = nvml_code(nvml, exc)
        if code == ERROR_GPU_IS_LOST:
            return CheckResult(Signal(uuid=uuid, kind=SignalKind.LOST, detail=f"while {step}"), "lost")
        if step == "looking up its handle" and code in (ERROR_NOT_FOUND, ERROR_INVALID_ARGUMENT):
            detail = "NVML no longer finds it by UUID"
            return CheckResult(Signal(uuid=uuid, kind=SignalKind.LOST, detail=detail), "lost")
        return CheckResult(None, f"inconclusive: {step}: {describe(nvml, exc)}")
    return CheckResult(Signal(uuid=uuid, kind=SignalKind.CHECK_OK), "ok")


def _garbage(uuid: str, detail: str) -> CheckResult:
    return CheckResult(Signal(uuid=uuid, kind=SignalKind.GARBAGE, detail=detail), f"garbage: {detail}")


def _optional(nvml: ModuleType, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except nvml.NVMLError as exc:
        if nvml_code(nvml, exc) in NOT_SUPPORTED_CODES:
            return None
        raise


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
    nvml: ModuleType, gpu: Gpu, *, interval_s: float, emit: SignalSink, in_flight: InFlight | None = None
) -> None:
    """Check one GPU every ``interval_s`` until cancelled; never raises otherwise.

    Each GPU has its own loop, so an NVML call that hangs on one GPU stalls only that
    GPU's checks. Logs when the outcome changes, not on every poll.
    """
    last = "ok"  # a first passing check is not news
    while True:
        try:
            if in_flight is None:
                result = await asyncio.to_thread(check_gpu, nvml, gpu)
            else:
                result = await asyncio.to_thread(in_flight.call, check_gpu, nvml, gpu)
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


# --- the event thread -------------------------------------------------------------------


class EventWatcher:
    """Runs NVML's blocking event wait in one dedicated thread.

    The thread owns the event set from ``nvmlEventSetCreate`` to ``nvmlEventSetFree``: it
    registers every GPU, waits in slices of ``wait_ms`` so that :meth:`stop` is noticed
    within one wait, and frees the set once its loop ends. Signals reach the event loop
    through ``loop.call_soon_threadsafe(emit, signal)``.

    Lifecycle: :meth:`start` once on the loop thread; :meth:`stop` (idempotent) sets the
    stop flag and joins the thread without blocking the loop.
    """

    def __init__(
        self,
        *,
        nvml: ModuleType,
        inventory: Inventory,
        wait_ms: int,
        emit: SignalSink,
        loop: asyncio.AbstractEventLoop,
        reduced_logged: set[str] | None = None,
    ) -> None:
        self._nvml = nvml
        self._gpus = inventory.gpus
        self._wait_ms = max(1, wait_ms)
        self._emit = emit
        self._loop = loop
        # uuids already logged as supporting fewer event types (logged once per device)
        self._reduced_logged = reduced_logged if reduced_logged is not None else set()
        self._migs = {
            (g.uuid, m.gpu_instance_id, m.compute_instance_id): m.uuid for g in self._gpus for m in g.mig_devices
        }
        self._stop = threading.Event()
        self._exited = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-events", daemon=True)
        self._kinds = {
            int(nvml.nvmlEventTypeXidCriticalError): SignalKind.XID,
            int(nvml.nvmlEventTypeDoubleBitEccError): SignalKind.ECC_DOUBLE_BIT,
            int(nvml.nvmlEventTypeSingleBitEccError): SignalKind.ECC_SINGLE_BIT,
        }

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def start(self) -> None:
        self._thread.start()

    async def wait_exited(self) -> None:
        """Returns when the thread has ended (on its own, or after :meth:`stop`)."""
        await self._exited.wait()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def stop(self) -> None:
        self._stop.set()
        if not self._thread.is_alive():
            return
        timeout = 2 * self._wait_ms / 1000 + 1.0
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            log.warning("NVML event thread did not stop in time; leaving it", timeout_s=timeout)

    # --- thread side ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._run_with_set()
        except Exception:
            log.exception("NVML event thread failed; Xid and ECC events are not reported")
        finally:
            self._call_on_loop(self._exited.set)

    def _run_with_set(self) -> None:
        nvml = self._nvml
        try:
            event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.warning("NVML event set unavailable; Xid and ECC events are not reported", error=describe(nvml, exc))
            return
        try:
            if self._register_all(event_set):
                self._wait_loop(event_set)
            else:
                log.warning("no GPU accepted NVML event registration; Xid and ECC events are not reported")
        finally:
            try:
                nvml.nvmlEventSetFree(event_set)
            except nvml.NVMLError as exc:
                log.warning("freeing the NVML event set failed", error=describe(nvml, exc))

    def _register_all(self, event_set: Any) -> int:
        nvml = self._nvml
        xid = int(nvml.nvmlEventTypeXidCriticalError)
        dbe = int(nvml.nvmlEventTypeDoubleBitEccError)
        sbe = int(nvml.nvmlEventTypeSingleBitEccError)
        masks = (xid | dbe | sbe, xid | dbe, xid)
        registered = 0
        for gpu in self._gpus:
            if self._stop.is_set():
                break
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
                for mask in masks:
                    try:
                        nvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
                    except nvml.NVMLError as exc:
                        if nvml_code(nvml, exc) in NOT_SUPPORTED_CODES:
                            continue
                        raise
                    registered += 1
                    if mask != masks[0]:
                        self._log_reduced(gpu.uuid, mask)
                    break
                else:
                    log.warning("GPU supports no health events; relying on periodic checks", uuid=gpu.uuid)
            except nvml.NVMLError as exc:
                if nvml_code(nvml, exc) == ERROR_GPU_IS_LOST:
                    self._send(Signal(uuid=gpu.uuid, kind=SignalKind.LOST, detail="while registering for events"))
                log.warning("registering for NVML events failed", uuid=gpu.uuid, error=describe(nvml, exc))
        return registered

    def _log_reduced(self, uuid: str, mask: int) -> None:
        if uuid in self._reduced_logged:
            return
        self._reduced_logged.add(uuid)
        kinds = [kind.value for bit, kind in self._kinds.items() if mask & bit]
        log.info("GPU supports only some health event types", uuid=uuid, events=kinds)

    def _wait_loop(self, event_set: Any) -> None:
        nvml = self._nvml
        backoff = BACKOFF_MIN_S
        while not self._stop.is_set():
            try:
                data = nvml.nvmlEventSetWait_v2(event_set, self._wait_ms)
            except nvml.NVMLError as exc:
                code = nvml_code(nvml, exc)
                if code == ERROR_TIMEOUT:
                    backoff = BACKOFF_MIN_S
                    continue
                if code == ERROR_GPU_IS_LOST:
                    self._report_lost()
                else:
                    log.warning("NVML event wait failed; retrying", error=describe(nvml, exc), backoff_s=backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                continue
            except Exception as exc:
                log.warning("NVML event wait failed; retrying", error=f"{type(exc).__name__}: {exc}", backoff_s=backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                continue
            backoff = BACKOFF_MIN_S
            self._dispatch(data)

    def _dispatch(self, data: Any) -> None:
        event_type = int(data.eventType)
        kind = self._kinds.get(event_type)
        if kind is None:
            log.debug("NVML event of an unrequested type ignored", event_type=hex(event_type))
            return
        xid = int(data.eventData) if kind is SignalKind.XID else None
        nvml = self._nvml
        try:
            parent = text(nvml.nvmlDeviceGetUUID(data.device))
        except nvml.NVMLError as exc:
            # As NVIDIA's device plugin does: an event we cannot attribute counts for every GPU.
            if nvml_code(nvml, exc) == ERROR_GPU_IS_LOST:
                self._report_lost()
            detail = f"event on a device NVML could not identify ({describe(nvml, exc)})"
            log.warning("NVML event for an unidentified device; reporting it for every GPU", kind=kind.value, xid=xid)
            for gpu in self._gpus:
                self._send(Signal(uuid=gpu.uuid, kind=kind, xid=xid, detail=detail))
            return
        uuid = self._target(parent, int(data.gpuInstanceId), int(data.computeInstanceId))
        self._send(Signal(uuid=uuid, kind=kind, xid=xid))

    def _target(self, parent: str, gi: int, ci: int) -> str:
        """The MIG device an event names through its GI/CI ids, else the GPU itself."""
        if gi == NO_INSTANCE:
            return parent
        if ci != NO_INSTANCE:
            return self._migs.get((parent, gi, ci), parent)
        candidates = [uuid for (p, g, _), uuid in self._migs.items() if p == parent and g == gi]
        return candidates[0] if len(candidates) == 1 else parent

    def _report_lost(self) -> None:
        """After the wait said GPU_IS_LOST: a LOST signal for each GPU that fails a check."""
        for gpu in self._gpus:
            try:
                result = check_gpu(self._nvml, gpu)
            except Exception:
                log.exception("checking a GPU after a lost-GPU event failed", uuid=gpu.uuid)
                continue
            if result.signal is not None and result.signal.kind is SignalKind.LOST:
                log.warning("GPU lost", uuid=gpu.uuid, detail=result.signal.detail)
                self._send(result.signal)

    def _send(self, signal: Signal) -> None:
        self._call_on_loop(self._emit, signal)

    def _call_on_loop(self, fn: Callable[..., object], *args: object) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._stop.set()
