"""The NVML event thread: Xid and ECC events for every GPU, in one thread per backend.

NVML delivers an event to every event set registered for it, so two event threads (an old
and a new inventory's, while a watch hands over) would report each Xid twice and a
"count N within T" rule would fire early. There is therefore one :class:`EventWatcher` per
backend: a new inventory is handed to it with :meth:`EventWatcher.follow` and the running
thread registers the new GPUs on its own set (``nvml.h``: operations on an event set are not
thread-safe, so only the thread that waits on the set touches it).

What the thread does when NVML misbehaves (each documented in ``nvml.h``):

* ``NVML_ERROR_UNKNOWN`` (or any error but the two below) from ``nvmlDeviceRegisterEvents``
  leaves the set "in undefined state": the set is freed and a new one created (after a
  backoff) without that GPU, which is tried again on a fresh set after 5 s, doubling up to
  5 minutes, so one GPU that keeps refusing cannot keep the others from being watched;
  ``NOT_SUPPORTED`` leaves the set usable, and fewer event types are tried; ``GPU_IS_LOST``
  reports that GPU lost.
* ``GPU_IS_LOST`` from the wait: each GPU is checked through its own handle and the lost
  ones are reported; the set is then re-created, so the lost GPU (whose registration now
  fails) cannot keep failing every wait for the others.
* An event names its device by handle: it is matched against the handles registered on the
  set (by the address they hold), never by reading the UUID back, which fails with
  ``GPU_IS_LOST`` for exactly the GPU an Xid 79 is about.
* Any other wait error: retried with a backoff (50 ms doubling to 5 s); after
  ``RECREATE_AFTER`` failures in a row the set is freed and re-created.
* While events cannot be received (no set, waits failing, a GPU that could not be
  registered) for longer than ``blind_after_s`` (timed per GPU: the moment a set is re-created
  around a refusing GPU does not count for the others), the affected GPUs are reported
  ``UNMONITORED``: an Xid on them would go unseen, so they are taken out of service as
  UNKNOWN rather than left "healthy" forever; ``MONITORED`` follows once events flow again.
  GPUs that support no event type at all are not blind (their periodic checks are all
  NVML offers) and lost GPUs are reported lost instead.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import structlog

from agent.backends.backend import SignalSink
from agent.backends.nvml.errors import ERROR_GPU_IS_LOST, ERROR_TIMEOUT, NOT_SUPPORTED_CODES, describe, nvml_code
from agent.backends.nvml.health import check_gpu
from agent.backends.nvml.inventory import text
from agent.core.health.model import Signal, SignalKind
from agent.core.inventory.model import Gpu, Inventory

log = structlog.get_logger("agent.nvml")

#: gpuInstanceId / computeInstanceId of an event that is not about a MIG device
NO_INSTANCE = 0xFFFFFFFF
#: backoff after a failed wait or event set: doubles from MIN to MAX, reset by a good wait
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 5.0
#: consecutive failed waits after which the event set is freed and created again
RECREATE_AFTER = 3
#: how long events may be unavailable before the affected GPUs are reported UNMONITORED
BLIND_AFTER_S = 30.0
#: a GPU whose registration broke the set is left out of the next sets, and tried again
#: (on a fresh set) after this long, doubling up to the maximum
REFUSED_RETRY_MIN_S = 5.0
REFUSED_RETRY_MAX_S = 300.0


@dataclass(frozen=True, slots=True)
class _Followed:
    """What the thread watches; replaced as a whole by :meth:`EventWatcher.follow`."""

    generation: int
    gpus: tuple[Gpu, ...]
    handles: Mapping[str, Any]
    migs: Mapping[tuple[str, int, int], str]  # (parent uuid, GI, CI) -> MIG uuid
    emit: SignalSink | None


@dataclass(slots=True)
class _SetState:
    """The thread's own bookkeeping about its event set (touched by the thread only)."""

    event_set: Any = None
    registered: set[str] = field(default_factory=set)  # GPU uuids registered on event_set
    by_handle: dict[object, str] = field(default_factory=dict)  # handle_key -> uuid, registered ones
    unsupported: set[str] = field(default_factory=set)  # GPUs that support no event type
    lost: set[str] = field(default_factory=set)  # GPUs whose registration said GPU_IS_LOST
    refused: set[str] = field(default_factory=set)  # GPUs whose registration broke a set
    refused_retry_at: float = 0.0
    refused_retry_s: float | None = None  # None: REFUSED_RETRY_MIN_S
    generation: int = -1  # of the followed inventory last registered
    waits_failing: bool = False
    failures: int = 0
    backoff: float = BACKOFF_MIN_S


class EventWatcher:
    """Runs NVML's blocking event wait in one dedicated thread until :meth:`stop`.

    Lifecycle: :meth:`start` once on the loop thread; :meth:`follow` any number of times
    (from the loop thread) to point it at an inventory and a sink; :meth:`stop` (idempotent)
    sets the stop flag and joins the thread without blocking the loop. After ``stop`` the
    thread never emits again, even if it does not end in time.
    """

    def __init__(
        self,
        *,
        nvml: ModuleType,
        wait_ms: Callable[[], int],
        loop: asyncio.AbstractEventLoop,
        blind_after_s: float = BLIND_AFTER_S,
        reduced_logged: set[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nvml = nvml
        self._wait_ms = wait_ms
        self._loop = loop
        self._blind_after_s = blind_after_s
        self._clock = clock
        # uuids already logged as supporting fewer event types (logged once per device)
        self._reduced_logged = reduced_logged if reduced_logged is not None else set()
        self._lock = threading.Lock()
        self._followed = _Followed(generation=0, gpus=(), handles={}, migs={}, emit=None)
        self._stop = threading.Event()
        self._exited = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-events", daemon=True)
        self._kinds = {
            int(nvml.nvmlEventTypeXidCriticalError): SignalKind.XID,
            int(nvml.nvmlEventTypeDoubleBitEccError): SignalKind.ECC_DOUBLE_BIT,
            int(nvml.nvmlEventTypeSingleBitEccError): SignalKind.ECC_SINGLE_BIT,
        }
        # for status(): written by the thread, read by the loop (single assignments)
        self._blind: frozenset[str] = frozenset()
        self._last_error: str | None = None
        self._sets_created = 0

    # --- loop side --------------------------------------------------------------------

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def follow(self, inventory: Inventory, handles: Mapping[str, Any], emit: SignalSink) -> int:
        """Watch ``inventory`` and report to ``emit`` from now on; returns a token for :meth:`unfollow`."""
        migs = {
            (g.uuid, m.gpu_instance_id, m.compute_instance_id): m.uuid for g in inventory.gpus for m in g.mig_devices
        }
        with self._lock:
            generation = self._followed.generation + 1
            self._followed = _Followed(
                generation=generation, gpus=inventory.gpus, handles=dict(handles), migs=migs, emit=emit
            )
        return generation

    def unfollow(self, token: int) -> None:
        """Stop reporting for ``token``'s follow, unless a newer :meth:`follow` replaced it."""
        with self._lock:
            if self._followed.generation == token:
                self._followed = _Followed(
                    generation=token, gpus=self._followed.gpus, handles=self._followed.handles, migs={}, emit=None
                )

    async def wait_exited(self) -> None:
        """Returns when the thread has ended (on its own, or after :meth:`stop`)."""
        await self._exited.wait()

    async def stop(self) -> None:
        self._stop.set()
        if not self._thread.is_alive():
            return
        timeout = 2 * max(1, self._wait_ms()) / 1000 + 1.0
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            log.warning("NVML event thread did not stop in time; leaving it", timeout_s=timeout)

    def status(self) -> dict[str, object]:
        return {
            "running": self._thread.is_alive() and not self._stop.is_set(),
            "unmonitored": sorted(self._blind),
            "last_error": self._last_error,
            "event_sets_created": self._sets_created,
        }

    # --- thread side ------------------------------------------------------------------

    def _snapshot(self) -> _Followed:
        with self._lock:
            return self._followed

    def _run(self) -> None:
        state = _SetState()
        try:
            self._watch(state)
        except Exception:
            log.exception("NVML event thread failed; Xid and ECC events are not reported")
        finally:
            self._free(state)
            self._call_on_loop(self._exited.set)

    def _watch(self, state: _SetState) -> None:
        # per GPU: a GPU that keeps refusing registration must not make the others' blips
        # (the set re-created around it, a 50 ms backoff) count as long blindness
        blind_since: dict[str, float] = {}
        reported: set[str] = set()
        while not self._stop.is_set():
            followed = self._snapshot()
            if state.refused and state.event_set is not None and self._clock() >= state.refused_retry_at:
                state.refused.clear()  # try them again, on a fresh set
                self._free(state)
            if state.event_set is None:
                self._create(state)
            if state.event_set is not None and state.generation != followed.generation:
                self._register(state, followed)
            if state.event_set is not None:
                self._wait_once(state, followed)
            blind = self._blind_now(state, followed)
            now = self._clock()
            blind_since = {uuid: blind_since.get(uuid, now) for uuid in blind}
            for uuid in sorted(blind - reported):
                if now - blind_since[uuid] >= self._blind_after_s:
                    self._send(Signal(uuid=uuid, kind=SignalKind.UNMONITORED, detail=self._last_error or ""))
                    reported.add(uuid)
            for uuid in sorted(reported - blind):
                self._send(Signal(uuid=uuid, kind=SignalKind.MONITORED))
            reported &= blind
            self._blind = frozenset(reported)
            if state.event_set is None or state.waits_failing:
                self._stop.wait(state.backoff)
                state.backoff = min(state.backoff * 2, BACKOFF_MAX_S)

    @staticmethod
    def _blind_now(state: _SetState, followed: _Followed) -> set[str]:
        """GPUs whose events cannot reach us now (lost GPUs and event-less GPUs excepted)."""
        uuids = {g.uuid for g in followed.gpus} - state.lost - state.unsupported
        if state.event_set is None or state.waits_failing:
            return uuids
        return uuids - state.registered

    def _create(self, state: _SetState) -> None:
        nvml = self._nvml
        try:
            state.event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            self._note_error("creating the NVML event set failed", describe(nvml, exc), state)
            return
        self._sets_created += 1
        state.registered, state.unsupported, state.lost = set(), set(), set()
        state.by_handle = {}
        state.generation = -1
        state.waits_failing = False

    def _free(self, state: _SetState) -> None:
        if state.event_set is None:
            return
        nvml = self._nvml
        event_set, state.event_set = state.event_set, None
        try:
            nvml.nvmlEventSetFree(event_set)
        except nvml.NVMLError as exc:
            log.warning("freeing the NVML event set failed", error=describe(nvml, exc))

    def _register(self, state: _SetState, followed: _Followed) -> None:
        """Register the followed GPUs not yet on the set; a set left undefined is freed."""
        nvml = self._nvml
        xid = int(nvml.nvmlEventTypeXidCriticalError)
        dbe = int(nvml.nvmlEventTypeDoubleBitEccError)
        sbe = int(nvml.nvmlEventTypeSingleBitEccError)
        masks = (xid | dbe | sbe, xid | dbe, xid)
        for gpu in followed.gpus:
            if self._stop.is_set():
                return
            if gpu.uuid in state.registered | state.unsupported | state.lost | state.refused:
                continue
            try:
                handle = followed.handles.get(gpu.uuid)
                if handle is None:
                    handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
                mask = self._register_one(event_set=state.event_set, handle=handle, masks=masks)
            except nvml.NVMLError as exc:
                code = nvml_code(nvml, exc)
                if code == ERROR_GPU_IS_LOST:
                    state.lost.add(gpu.uuid)
                    self._send(Signal(uuid=gpu.uuid, kind=SignalKind.LOST, detail="while registering for events"))
                    log.warning("GPU lost while registering for NVML events", uuid=gpu.uuid)
                    continue
                # nvml.h: after any other failure the set is in an undefined state; start over
                # without this GPU, and give it another chance later on a fresh set
                self._note_error(f"registering GPU {gpu.uuid} for NVML events failed", describe(nvml, exc), state)
                state.refused.add(gpu.uuid)
                retry = REFUSED_RETRY_MIN_S if state.refused_retry_s is None else state.refused_retry_s
                state.refused_retry_at = self._clock() + retry
                state.refused_retry_s = min(retry * 2, REFUSED_RETRY_MAX_S)
                self._free(state)
                state.waits_failing = True
                return
            if mask is None:
                state.unsupported.add(gpu.uuid)
                log.warning("GPU supports no health events; relying on periodic checks", uuid=gpu.uuid)
                continue
            state.registered.add(gpu.uuid)
            state.by_handle[handle_key(handle)] = gpu.uuid
            if mask != masks[0]:
                self._log_reduced(gpu.uuid, mask)
        state.generation = followed.generation

    def _register_one(self, *, event_set: Any, handle: Any, masks: tuple[int, ...]) -> int | None:
        """The mask that registered, or None when the GPU supports none of them."""
        nvml = self._nvml
        for mask in masks:
            try:
                nvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
            except nvml.NVMLError as exc:
                if nvml_code(nvml, exc) in NOT_SUPPORTED_CODES:
                    continue
                raise
            return mask
        return None

    def _log_reduced(self, uuid: str, mask: int) -> None:
        if uuid in self._reduced_logged:
            return
        self._reduced_logged.add(uuid)
        kinds = [kind.value for bit, kind in self._kinds.items() if mask & bit]
        log.info("GPU supports only some health event types", uuid=uuid, events=kinds)

    def _wait_once(self, state: _SetState, followed: _Followed) -> None:
        nvml = self._nvml
        try:
            data = nvml.nvmlEventSetWait_v2(state.event_set, max(1, int(self._wait_ms())))
        except nvml.NVMLError as exc:
            code = nvml_code(nvml, exc)
            if code == ERROR_TIMEOUT:
                self._waited_fine(state)
                return
            if code == ERROR_GPU_IS_LOST:
                self._report_lost(followed)
                self._note_error("NVML event wait: a GPU is lost; new event set", describe(nvml, exc), state)
                self._free(state)
                return
            self._wait_failed(state, describe(nvml, exc))
            return
        except Exception as exc:  # a binding bug: treat like any other failed wait
            self._wait_failed(state, f"{type(exc).__name__}: {exc}")
            return
        self._waited_fine(state)
        self._dispatch(data, followed, state)

    def _waited_fine(self, state: _SetState) -> None:
        if state.waits_failing or state.failures:
            log.info("NVML event wait works again")
        state.waits_failing = False
        state.failures = 0
        state.backoff = BACKOFF_MIN_S

    def _wait_failed(self, state: _SetState, error: str) -> None:
        state.failures += 1
        state.waits_failing = True
        if state.failures >= RECREATE_AFTER:
            self._note_error("NVML event wait keeps failing; re-creating the event set", error, state)
            self._free(state)
            state.failures = 0
        else:
            self._note_error("NVML event wait failed; retrying", error, state)

    def _note_error(self, message: str, error: str, state: _SetState) -> None:
        self._last_error = f"{message}: {error}"
        log.warning(message, error=error, backoff_s=state.backoff)

    def _dispatch(self, data: Any, followed: _Followed, state: _SetState) -> None:
        event_type = int(data.eventType)
        kind = self._kinds.get(event_type)
        if kind is None:
            log.debug("NVML event of an unrequested type ignored", event_type=hex(event_type))
            return
        xid = int(data.eventData) if kind is SignalKind.XID else None
        # the handle we registered names the GPU even when it is lost (its UUID no longer reads)
        parent = state.by_handle.get(handle_key(data.device))
        if parent is None:
            self._dispatch_unregistered(data, followed, kind, xid)
            return
        uuid = self._target(followed, parent, int(data.gpuInstanceId), int(data.computeInstanceId))
        self._send(Signal(uuid=uuid, kind=kind, xid=xid))

    def _dispatch_unregistered(self, data: Any, followed: _Followed, kind: SignalKind, xid: int | None) -> None:
        """An event whose handle is none we registered (not seen in practice): ask NVML for its UUID."""
        nvml = self._nvml
        try:
            parent = text(nvml.nvmlDeviceGetUUID(data.device))
        except nvml.NVMLError as exc:
            # As NVIDIA's device plugin does: an event we cannot attribute counts for every GPU.
            if nvml_code(nvml, exc) == ERROR_GPU_IS_LOST:
                self._report_lost(followed)
            detail = f"event on a device NVML could not identify ({describe(nvml, exc)})"
            log.warning("NVML event for an unidentified device; reporting it for every GPU", kind=kind.value, xid=xid)
            for gpu in followed.gpus:
                self._send(Signal(uuid=gpu.uuid, kind=kind, xid=xid, detail=detail))
            return
        uuid = self._target(followed, parent, int(data.gpuInstanceId), int(data.computeInstanceId))
        self._send(Signal(uuid=uuid, kind=kind, xid=xid))

    @staticmethod
    def _target(followed: _Followed, parent: str, gi: int, ci: int) -> str:
        """The MIG device an event names through its GI/CI ids, else the GPU itself."""
        if gi == NO_INSTANCE:
            return parent
        if ci != NO_INSTANCE:
            return followed.migs.get((parent, gi, ci), parent)
        candidates = [uuid for (p, g, _), uuid in followed.migs.items() if p == parent and g == gi]
        return candidates[0] if len(candidates) == 1 else parent

    def _report_lost(self, followed: _Followed) -> None:
        """After NVML said some GPU is lost: a LOST signal for each GPU its own handle says is lost."""
        for gpu in followed.gpus:
            try:
                result = check_gpu(self._nvml, gpu, followed.handles.get(gpu.uuid))
            except Exception:
                log.exception("checking a GPU after a lost-GPU event failed", uuid=gpu.uuid)
                continue
            if result.signal is not None and result.signal.kind is SignalKind.LOST:
                log.warning("GPU lost", uuid=gpu.uuid, detail=result.signal.detail)
                self._send(result.signal)

    def _send(self, signal: Signal) -> None:
        if not self._stop.is_set():
            self._call_on_loop(self._deliver, signal)

    def _deliver(self, signal: Signal) -> None:
        """On the loop: hand the signal to whoever is followed now (nobody after stop)."""
        if self._stop.is_set():
            return
        emit = self._snapshot().emit
        if emit is None:
            return
        try:
            emit(signal)
        except Exception:
            log.exception("health signal sink failed", uuid=signal.uuid, kind=signal.kind.value)

    def _call_on_loop(self, fn: Callable[..., object], *args: object) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._stop.set()


def handle_key(handle: object) -> object:
    """What identifies an NVML device handle across calls.

    nvidia-ml-py's handles are ctypes pointers (``c_nvmlDevice_t``): every call, and every read
    of ``c_nvmlEventData_t.device``, gives a new Python object, and pointers compare by identity.
    Two handles of one device hold the same address. Any other handle type (a test double)
    is its own key.
    """
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle
