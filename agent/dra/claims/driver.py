"""Claim preparation: the domain behind NodePrepareResources and NodeUnprepareResources.

:class:`DraDriver` orchestrates a call; what it uses, one concept each: the prepared claims and
their checkpoint (:class:`~agent.dra.claims.prepared.PreparedClaims`), the per-claim locks
(:class:`~agent.dra.claims.locks.ClaimLocks`), the devices reserved by claims in flight
(:class:`~agent.dra.claims.reservations.Reservations`) and the batched CDI claim specs
(:class:`~agent.dra.claims.specwriter.ClaimSpecWriter`). The servicers call
:meth:`DraDriver.prepare` and :meth:`DraDriver.unprepare` with the kubelet's claim references
and translate the answers; nothing here knows gRPC.

Contract (what the kubelet relies on, ``kubelet-dra.md`` §5):

* exactly one answer per requested claim UID; a failing claim gets an error string in its
  answer, the others are unaffected; the calls themselves never fail;
* a claim already prepared is answered from the checkpoint, identically, without the API;
  an unknown or already unprepared claim unprepares successfully;
* the answer comes well inside the kubelet's 45 s deadline: one API read is bounded by
  ``PrepareTimeouts.api_s``, waiting for another call that works on the same claim by
  ``PrepareTimeouts.lock_s``, each ending in a per-claim error that names the bound;
* a batch costs one checkpoint write (fsync), and concurrent batches share writes.

How a call is prepared, in three steps (each claim under its own lock, so two calls for one
claim never interleave):

1. per claim, concurrently: the stored answer if it is prepared already; otherwise read the
   claim, decide with :func:`~agent.dra.claims.plan.plan_claim`, and *reserve* its devices
   (synchronously: no ``await`` between the check that a device is free and the reservation,
   so claims prepared concurrently, in one call or in several, never get the same device);
2. the call's new claims get their CDI specs in one write (one worker-thread hop, one
   directory fsync); a claim whose spec fails is answered with the error, the others go on;
   those that got a spec are recorded in memory and their reservations dropped;
3. one checkpoint write for the call. If it fails, the call's new claims are taken back out
   (and their CDI specs) and fail; claims answered from the checkpoint are unaffected.

Which claims may share a device: see :mod:`agent.dra.claims.reservations`.

The work of a call runs in its own task, shielded from the call: a kubelet that gives up
(deadline, restart) does not cut a preparation in half; the claim ends up prepared and
checkpointed and the kubelet's retry gets the stored answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

import structlog

from agent.base.errors import AgentError
from agent.cdi.errors import CdiError
from agent.cdi.names import check_claim_uid
from agent.core.inventory.model import Inventory
from agent.core.node import NodeFacts
from agent.dra.claims.checkpoint import CheckpointError, PreparedClaim, utc_now
from agent.dra.claims.errors import ClaimError, Reason, quote
from agent.dra.claims.locks import ClaimLocks
from agent.dra.claims.pending import PendingClaim
from agent.dra.claims.plan import PlannedDevice, plan_claim
from agent.dra.claims.prepared import PreparedClaims
from agent.dra.claims.reservations import Reservations
from agent.dra.claims.specwriter import ClaimSpecWriter
from agent.dra.devices import DraDevice, dra_devices
from agent.dra.metrics import DraMetrics
from agent.kube.claims.model import ClaimRef, ClaimSource, ResourceClaim

log = structlog.get_logger("agent.dra")

T = TypeVar("T")

#: claims prepared on one node at once; past it a new claim fails (a bound on memory and on the checkpoint)
MAX_PREPARED = 4096
#: claims in one call
MAX_BATCH = 512


@dataclass(frozen=True, slots=True)
class PrepareTimeouts:
    """Bounds on the waits of one NodePrepareResources or NodeUnprepareResources call."""

    #: one ResourceClaim read from the API server
    api_s: float = 10.0
    #: waiting for other calls that work on the same claims (the lock phase of a call)
    lock_s: float = 15.0


DEFAULT_PREPARE_TIMEOUTS = PrepareTimeouts()


@dataclass(frozen=True, slots=True)
class DeviceAnswer:
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    request_names: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True, slots=True)
class ClaimAnswer:
    devices: tuple[DeviceAnswer, ...] = ()
    error: str = ""


def answer_of(claim: PreparedClaim) -> ClaimAnswer:
    """The kubelet's answer for a prepared claim: a function of the checkpoint entry alone."""
    return ClaimAnswer(
        devices=tuple(
            DeviceAnswer(pool=d.pool, device=d.name, cdi_ids=d.cdi_ids, request_names=d.requests, share_id=d.share_id)
            for d in claim.devices
        )
    )


@dataclass(slots=True)
class _Outcome:
    ref: ClaimRef
    answer: ClaimAnswer
    #: the entry this call added (None: answered from the checkpoint, or failed)
    new: PreparedClaim | None = None
    #: the entry it replaced (an incomplete one rebuilt from CDI specs)
    replaced: PreparedClaim | None = None


class DraDriver:
    def __init__(
        self,
        *,
        driver_name: str,
        pool: str,
        claims: ClaimSource,
        node: NodeFacts,
        prepared: PreparedClaims,
        specs: ClaimSpecWriter,
        metrics: DraMetrics,
        timeouts: PrepareTimeouts = DEFAULT_PREPARE_TIMEOUTS,
        now: Callable[[], str] = utc_now,
    ) -> None:
        self.driver_name = driver_name
        self.pool = pool
        self._claims = claims
        self._inventory = node.inventory
        self._ownership = node.ownership
        self._health = node.health
        #: the prepared claims and their checkpoint: the one copy, read by the mechanism and CDI too
        self.prepared = prepared
        self._specs = specs
        self._metrics = metrics
        self._timeouts = timeouts
        self._now = now
        self._reservations = Reservations(prepared)
        self._locks = ClaimLocks(timeouts.lock_s)
        self._inflight: set[asyncio.Task[object]] = set()
        self._devices: tuple[Inventory | None, dict[str, DraDevice]] = (None, {})

    # --- reads ------------------------------------------------------------------------------

    def in_preparation(self) -> list[tuple[ClaimRef, list[PlannedDevice]]]:
        """Claims whose devices are reserved while their preparation is in flight."""
        return self._reservations.in_preparation()

    # --- start ------------------------------------------------------------------------------

    async def restore(self) -> None:
        """Load the checkpoint (or rebuild it from the CDI claim specs); once, before serving.

        Raises StartupError only when the state directory cannot be read at all.
        """
        await self.prepared.restore(self._rebuild)

    def _rebuild(self) -> dict[str, PreparedClaim]:
        return self._specs.read_back(dra_devices(self._inventory.current), pool=self.pool, now=self._now())

    # --- prepare ----------------------------------------------------------------------------

    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimAnswer]:
        """One answer per distinct claim UID in ``refs`` (see the module docstring)."""
        return await self._shielded(self._prepare_batch(_distinct(refs)), "dra-prepare")

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        """Claim UID -> error ("" when done) for every distinct UID in ``refs``."""
        return await self._shielded(self._unprepare_batch(_distinct(refs)), "dra-unprepare")

    async def _shielded(self, work: Awaitable[T], name: str) -> T:
        task: asyncio.Task[T] = asyncio.ensure_future(work)
        task.set_name(name)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return await asyncio.shield(task)

    async def close(self) -> None:
        """Cancel calls still in flight (shutdown) and wait for them to clean up."""
        tasks = list(self._inflight)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _prepare_batch(self, refs: list[ClaimRef]) -> dict[str, ClaimAnswer]:
        if len(refs) > MAX_BATCH:
            message = f"{len(refs)} claims in one call, at most {MAX_BATCH}"
            return {r.uid: self._failed("prepare", ClaimError(Reason.BAD_REQUEST, message)) for r in refs}
        started = time.perf_counter()
        answers: dict[str, ClaimAnswer] = {}
        async with self._locks.hold(refs) as (held, busy):
            for ref in busy:
                answers[ref.uid] = self._failed("prepare", self._busy_error(ref))
            # 1. per claim, concurrently: the stored answer, or read, decide and reserve
            firsts = await asyncio.gather(*(self._plan_one(ref) for ref in held))
            outcomes = {o.ref.uid: o for o in firsts if isinstance(o, _Outcome)}
            pending = [p for p in firsts if isinstance(p, PendingClaim)]
            # 2. the batch's CDI specs in one go; 3. one checkpoint write for the batch
            try:
                outcomes.update(await self._write_specs(pending))
            finally:
                for p in pending:
                    self._reservations.release(p.ref.uid)
            new = [o for o in outcomes.values() if o.new is not None]
            if new:
                try:
                    await self.prepared.persist()
                except CheckpointError as exc:
                    await self._undo_prepare(new, exc)
            self._metrics.prepares.labels(result="prepared").inc(sum(1 for o in outcomes.values() if o.new))
            for ref in held:
                answers[ref.uid] = outcomes[ref.uid].answer
        now = time.perf_counter()
        for _ in refs:  # every claim of a call is answered when the call is
            self._metrics.claim_seconds.labels(operation="prepare").observe(now - started)
        self._metrics.prepared.set(len(self.prepared))
        return answers

    async def _plan_one(self, ref: ClaimRef) -> _Outcome | PendingClaim:
        with structlog.contextvars.bound_contextvars(claim=f"{ref.namespace}/{ref.name}", claim_uid=ref.uid):
            try:
                return await self._plan_claim(ref)
            except ClaimError as exc:
                return _Outcome(ref, self._failed("prepare", exc))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug, or a rude ClaimSource: this claim fails, not the call
                log.exception("dra.prepare_crashed")
                return _Outcome(ref, self._failed("prepare", ClaimError(Reason.INTERNAL, f"internal error: {exc!r}")))

    async def _plan_claim(self, ref: ClaimRef) -> _Outcome | PendingClaim:
        existing = self.prepared.get(ref.uid)
        if existing is not None and existing.complete:
            self._metrics.prepares.labels(result="already-prepared").inc()
            return _Outcome(ref, answer_of(existing))
        _check_ref(ref)
        if existing is None and len(self.prepared) + len(self._reservations) >= MAX_PREPARED:
            raise ClaimError(Reason.BAD_REQUEST, f"{MAX_PREPARED} claims are prepared on this node already")
        claim = await self._read_claim(ref)
        planned = plan_claim(
            ref,
            claim,
            driver=self.driver_name,
            pool=self.pool,
            devices=self._devices_by_name(),
            ownership=self._ownership.current,
            health=self._health,
        )
        self._reservations.reserve(ref, planned)
        allocated_at = claim.allocation_timestamp if claim is not None else None
        return PendingClaim(ref=ref, planned=planned, existing=existing, allocated_at=allocated_at)

    async def _write_specs(self, pending: list[PendingClaim]) -> dict[str, _Outcome]:
        """Write the CDI specs of the batch's new claims and record the ones that got theirs."""
        if not pending:
            return {}
        written = await self._specs.write({p.ref.uid: p.cdi_devices() for p in pending})
        outcomes: dict[str, _Outcome] = {}
        for p in pending:
            names = written[p.ref.uid]
            if isinstance(names, CdiError):
                error = ClaimError(Reason.CDI_ERROR, f"writing the claim's CDI spec failed: {names}")
                outcomes[p.ref.uid] = _Outcome(p.ref, self._failed("prepare", error))
                continue
            prepared = p.prepared(names, self._now())
            self.prepared.record(prepared)
            self._observe_allocation_age(p.allocated_at)
            log.info(
                "dra.claim_prepared",
                claim=f"{p.ref.namespace}/{p.ref.name}",
                claim_uid=p.ref.uid,
                devices=[d.name for d in prepared.devices],
                completed=p.existing is not None,
            )
            outcomes[p.ref.uid] = _Outcome(p.ref, answer_of(prepared), new=prepared, replaced=p.existing)
        return outcomes

    def gpu_of_device(self, name: str) -> str | None:
        """The physical GPU behind one of this node's DRA device names (None: not a device of ours)."""
        device = self._devices_by_name().get(name)
        return device.gpu_uuid if device is not None else None

    def _devices_by_name(self) -> dict[str, DraDevice]:
        """The node's DRA devices by name, computed once per inventory (inventories are immutable)."""
        inventory = self._inventory.current
        if self._devices[0] is not inventory:
            self._devices = (inventory, {d.name: d for d in dra_devices(inventory)})
        return self._devices[1]

    async def _read_claim(self, ref: ClaimRef) -> ResourceClaim | None:
        what = f"reading ResourceClaim {ref.namespace}/{ref.name} from the API server"
        try:
            async with asyncio.timeout(self._timeouts.api_s):
                return await self._claims.get_claim(ref)
        except TimeoutError as exc:
            raise ClaimError(Reason.TIMEOUT, f"{what} took longer than {self._timeouts.api_s:g}s") from exc
        except AgentError as exc:
            raise ClaimError(Reason.API_ERROR, f"{what} failed: {exc}") from exc

    async def _undo_prepare(self, outcomes: list[_Outcome], exc: CheckpointError) -> None:
        """The checkpoint did not record this batch: its new claims are not prepared after all."""
        error = ClaimError(Reason.CHECKPOINT_ERROR, f"recording the claim in the checkpoint failed: {exc}")
        undone: list[str] = []
        for outcome in outcomes:  # memory first, before any await: no later write may record them
            assert outcome.new is not None
            uid = outcome.new.uid
            if outcome.replaced is not None:
                self.prepared.record(outcome.replaced)
            else:
                self.prepared.remove(uid)
                undone.append(uid)
            outcome.new = None
            outcome.answer = self._failed("prepare", error)
        if undone:
            await self._specs.discard(undone)

    # --- unprepare --------------------------------------------------------------------------

    async def _unprepare_batch(self, refs: list[ClaimRef]) -> dict[str, str]:
        if len(refs) > MAX_BATCH:
            message = f"{len(refs)} claims in one call, at most {MAX_BATCH}"
            return {r.uid: self._failed("unprepare", ClaimError(Reason.BAD_REQUEST, message)).error for r in refs}
        started = time.perf_counter()
        errors: dict[str, str] = {}
        async with self._locks.hold(refs) as (held, busy):
            for ref in busy:
                errors[ref.uid] = self._failed("unprepare", self._busy_error(ref)).error
            removed_specs = await self._specs.remove([r.uid for r in held])
            removed: list[PreparedClaim] = []
            for ref in held:
                errors[ref.uid] = self._forget(ref, removed_specs.get(ref.uid), removed)
            if removed:
                try:
                    await self.prepared.persist()
                except CheckpointError as exc:
                    message = f"removing the claim from the checkpoint failed: {exc}"
                    for claim in removed:  # still recorded on disk: keep them, the kubelet retries
                        self.prepared.record(claim)
                        errors[claim.uid] = self._failed(
                            "unprepare", ClaimError(Reason.CHECKPOINT_ERROR, message)
                        ).error
                else:
                    self._metrics.unprepares.labels(result="unprepared").inc(len(removed))
        now = time.perf_counter()
        for _ in refs:  # every claim of a call is answered when the call is
            self._metrics.claim_seconds.labels(operation="unprepare").observe(now - started)
        self._metrics.prepared.set(len(self.prepared))
        return errors

    def _forget(self, ref: ClaimRef, spec_error: CdiError | None, removed: list[PreparedClaim]) -> str:
        """Drop the claim from memory once its CDI spec is gone; its error text, or ""."""
        if spec_error is not None:
            error = ClaimError(Reason.CDI_ERROR, f"removing the claim's CDI spec failed: {spec_error}")
            return self._failed("unprepare", error).error
        existing = self.prepared.remove(ref.uid)
        if existing is None:
            self._metrics.unprepares.labels(result="not-prepared").inc()
            return ""
        removed.append(existing)
        log.info("dra.claim_unprepared", claim=f"{existing.namespace}/{existing.name}", claim_uid=ref.uid)
        return ""

    # --- shared -----------------------------------------------------------------------------

    def _observe_allocation_age(self, allocated_at: str | None) -> None:
        """Time from the claim's allocation to now; skipped when unknown or ahead of our clock (skew)."""
        if not allocated_at:
            return
        try:
            at = datetime.fromisoformat(allocated_at)
        except ValueError:
            return
        if at.tzinfo is None:
            at = at.replace(tzinfo=UTC)
        age = time.time() - at.timestamp()
        if age >= 0:
            self._metrics.allocation_to_prepare.observe(age)

    def _failed(self, operation: str, exc: ClaimError) -> ClaimAnswer:
        self._metrics.errors.labels(operation=operation, reason=exc.reason.value).inc()
        counter = self._metrics.prepares if operation == "prepare" else self._metrics.unprepares
        counter.labels(result="error").inc()
        log.warning(f"dra.{operation}_failed", reason=exc.reason.value, error=str(exc))
        return ClaimAnswer(error=str(exc))

    def _busy_error(self, ref: ClaimRef) -> ClaimError:
        return ClaimError(
            Reason.TIMEOUT,
            f"claim {ref.uid}: another call still works on it after {self._timeouts.lock_s:g}s; try again",
        )


def _distinct(refs: Iterable[ClaimRef]) -> list[ClaimRef]:
    """The first reference of each UID, in request order (the answer is keyed by UID)."""
    seen: dict[str, ClaimRef] = {}
    for ref in refs:
        seen.setdefault(ref.uid, ref)
    return list(seen.values())


#: what the kubelet may put in a claim reference (Kubernetes' own limits)
_MAX_NAMESPACE = 63
_MAX_NAME = 253


def _check_ref(ref: ClaimRef) -> None:
    try:
        check_claim_uid(ref.uid)
    except CdiError as exc:
        raise ClaimError(Reason.BAD_REQUEST, str(exc), recoverable=False) from exc
    if not ref.namespace or len(ref.namespace) > _MAX_NAMESPACE or not ref.name or len(ref.name) > _MAX_NAME:
        raise ClaimError(
            Reason.BAD_REQUEST,
            f"claim reference {quote(ref.namespace)}/{quote(ref.name)}: namespace and name must be set "
            f"(at most {_MAX_NAMESPACE} and {_MAX_NAME} characters)",
            recoverable=False,
        )
