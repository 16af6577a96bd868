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
   claim, decide with :func:`~agent.dra.claims.plan.plan_claim` against the devices of each
   GPU's current shape (:mod:`agent.dra.modes`), and *reserve* its devices (synchronously: no
   ``await`` between the check that a device is free and the reservation, so claims prepared
   concurrently, in one call or in several, never get the same device, overlapping MIG
   placements, or more of a shared GPU's memory than it has);
   then the MIG instances the new claims need are made
   (:class:`~agent.dra.claims.instances.InstanceMaker`: recorded in the checkpoint first, all
   or nothing per claim) and the MPS daemons their shares need are running
   (:class:`~agent.dra.claims.shares.MpsShares`);
2. the call's new claims get their CDI specs in one write (one worker-thread hop, one
   directory fsync); a claim whose spec fails is answered with the error (and its instances
   destroyed), the others go on; those that got a spec are recorded in memory and their
   reservations dropped;
3. one checkpoint write for the call. If it fails, the call's new claims are taken back out
   (their CDI specs and instances too) and fail; claims answered from the checkpoint are
   unaffected.

Unprepare removes the claim's CDI spec, destroys the MIG instances made for it (one that cannot
be destroyed keeps the claim prepared and answers an error: the kubelet tries again), forgets
the claim and stops MPS daemons no share needs any more.

Which claims may share a device: see :mod:`agent.dra.claims.reservations`.

The work of a call runs in its own task, shielded from the call: a kubelet that gives up
(deadline, restart) does not cut a preparation in half; the claim ends up prepared and
checkpointed and the kubelet's retry gets the stored answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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
from agent.core.partitioning import MigControl, MpsControl, NoMig, NoMps
from agent.dra.claims.checkpoint import CheckpointError, CreatedInstance, PreparedClaim, utc_now
from agent.dra.claims.errors import ClaimError, Reason, quote
from agent.dra.claims.instances import InstanceMaker, Reload
from agent.dra.claims.locks import ClaimLocks
from agent.dra.claims.pending import PendingClaim
from agent.dra.claims.plan import PlannedDevice, plan_claim
from agent.dra.claims.prepared import PreparedClaims
from agent.dra.claims.reservations import InUse, Reservations
from agent.dra.claims.shares import MpsShares
from agent.dra.claims.specwriter import ClaimSpecWriter
from agent.dra.devices import DraDevice
from agent.dra.metrics import DraMetrics
from agent.dra.modes import Held, ModeGate
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
    #: waiting for a device another claim still holds to be let go: the scheduler gives a device
    #: to the next claim as soon as the old pod is deleted, before the kubelet has unprepared the
    #: old claim (measured: the same second); refused at once, the kubelet retries only after
    #: about a minute of back-off
    held_s: float = 10.0


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
        gate: ModeGate | None = None,
        mig: MigControl | None = None,
        mps: MpsControl | None = None,
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
        self._reservations = Reservations(prepared, lambda: prepared.instances)
        self._locks = ClaimLocks(timeouts.lock_s)
        self._inflight: set[asyncio.Task[object]] = set()
        #: each GPU's shape now: the devices a claim may name
        self.gate = gate or ModeGate(inventory=node.inventory)
        self.gate.attach(held=self.held, instances=lambda: prepared.instances, version=self.holdings_version)
        self.instances = InstanceMaker(mig=mig or NoMig(), prepared=prepared)
        self.shares = MpsShares(mps=mps or NoMps())

    def set_inventory_reload(self, reload: Reload) -> None:
        """How to re-read the inventory at once (after MIG instances appear or vanish)."""
        self.instances.set_reload(reload)

    # --- reads ------------------------------------------------------------------------------

    def in_preparation(self) -> list[tuple[ClaimRef, list[PlannedDevice]]]:
        """Claims whose devices are reserved while their preparation is in flight."""
        return self._reservations.in_preparation()

    def held(self) -> list[Held]:
        """Every device a prepared claim or a claim in preparation holds (the mode gate's input)."""
        out = [Held.of(_who(claim), d) for claim in self.prepared.values() for d in claim.devices]
        for ref, planned in self._reservations.in_preparation():
            out += [Held.planned(f"{ref.namespace}/{ref.name}", p.device) for p in planned]
        return out

    def holdings_version(self) -> tuple[int, int]:
        return (self.prepared.version, self._reservations.version)

    @property
    def inventory(self) -> Inventory:
        return self._inventory.current

    def health_uuid(self, device: DraDevice) -> str:
        """Whose health a published device reports: the MIG instance made for it, else its GPU's."""
        if device.partition is not None:
            for record in self.prepared.instances:
                if (
                    record.uuid is not None
                    and record.gpu_uuid == device.gpu_uuid
                    and record.placement == device.partition.placement
                ):
                    return record.uuid
        return device.uuid

    # --- start ------------------------------------------------------------------------------

    async def restore(self) -> None:
        """Load the checkpoint (or rebuild it from the CDI claim specs); once, before serving.

        Raises StartupError only when the state directory cannot be read at all.
        """
        await self.prepared.restore(self._rebuild)
        status = self.prepared.checkpoint
        if status.from_earlier_boot:
            self._forget_instances_of_an_earlier_boot()
        elif status.loaded == "corrupt":
            self._adopt_rebuilt_instances()

    def _rebuild(self) -> dict[str, PreparedClaim]:
        return self._specs.read_back(self.gate.devices(), self._inventory.current, pool=self.pool, now=self._now())

    def _forget_instances_of_an_earlier_boot(self) -> None:
        """MIG instances do not survive a reboot: forget them, and the claims that held them (the
        kubelet prepares such a claim again, and gets a new instance). Nothing is destroyed: after
        a reboot an instance ID may belong to an instance someone else made."""
        for record in self.prepared.instances:
            self.prepared.drop_instance(record)
        gone = [uid for uid, c in self.prepared.items() if any(d.placement is not None for d in c.devices)]
        for uid in gone:
            self.prepared.remove(uid)
        if gone:
            log.info("dra.mig_claims_of_earlier_boot_forgotten", claims=len(gone))

    def _adopt_rebuilt_instances(self) -> None:
        """A checkpoint rebuilt from CDI specs: the MIG instances those specs name are the agent's."""
        inventory = self._inventory.current
        for uid, claim in self.prepared.items():
            for device in claim.devices:
                mig = inventory.find_mig(device.uuid)
                if device.placement is None or device.profile_id is None or mig is None:
                    continue
                self.prepared.record_instance(
                    CreatedInstance(
                        gpu_uuid=device.gpu_uuid,
                        profile_id=device.profile_id,
                        placement=device.placement,
                        claim_uid=uid,
                        uuid=mig.uuid,
                        gpu_instance_id=mig.gpu_instance_id,
                        compute_instance_id=mig.compute_instance_id,
                    )
                )

    async def start(self) -> None:
        """After the checkpoint is loaded, before serving: destroy the MIG instances the agent made
        that no prepared claim needs, and start the MPS daemons prepared shares use."""
        await self.instances.collect(needed=self.prepared.__contains__)
        await self.shares.resume(self._mps_gpus().items())
        self.gate.refresh()

    def _mps_gpus(self) -> dict[str, int]:
        """GPU -> its memory (bytes), for every GPU an MPS share holds (prepared or being prepared)."""
        out: dict[str, int] = {}
        for claim in self.prepared.values():
            for d in claim.devices:
                if d.mps:
                    out[d.gpu_uuid] = self._memory_of(d.gpu_uuid)
        for _, planned in self._reservations.in_preparation():
            for p in planned:
                if p.device.share is not None and p.device.share.mps:
                    out[p.device.gpu_uuid] = p.device.share.memory
        return out

    def _memory_of(self, gpu_uuid: str) -> int:
        gpu = self._inventory.current.find(gpu_uuid)
        return gpu.memory_mib << 20 if gpu is not None else 0

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
            # then the MIG instances and MPS daemons they need
            reserved = [p.ref.uid for p in pending]
            try:
                pending = await self._set_up(pending, outcomes)
                # 2. the batch's CDI specs in one go, and beside them one checkpoint write for the batch
                outcomes.update(await self._write_specs(pending))
            finally:
                for uid in reserved:
                    self._reservations.release(uid)
            new = [o for o in outcomes.values() if o.new is not None]
            if new:
                try:
                    await self.prepared.persist()
                except CheckpointError as exc:
                    await self._undo_prepare(new, exc)
            elif reserved:  # instance records may have changed (made, then destroyed or not)
                with contextlib.suppress(CheckpointError):  # logged; the next write records them
                    await self.prepared.persist()
            self._metrics.prepares.labels(result="prepared").inc(sum(1 for o in outcomes.values() if o.new))
            for ref in held:
                answers[ref.uid] = outcomes[ref.uid].answer
            self.gate.refresh()
        now = time.perf_counter()
        for _ in refs:  # every claim of a call is answered when the call is
            self._metrics.claim_seconds.labels(operation="prepare").observe(now - started)
        self._metrics.prepared.set(len(self.prepared))
        return answers

    async def _set_up(self, pending: list[PendingClaim], outcomes: dict[str, _Outcome]) -> list[PendingClaim]:
        """Make the batch's MIG instances and start its MPS daemons; failed claims join ``outcomes``
        (with nothing of theirs left)."""
        refs = {p.ref.uid: p.ref for p in pending}
        pending, failed = await self.instances.make(pending)
        pending, failed_mps = await self.shares.setup(pending)
        if failed_mps:
            await self.instances.destroy([uid for uid in failed_mps if refs[uid].uid not in self.prepared], quiet=True)
            failed.update(failed_mps)
        for uid, error in failed.items():
            outcomes[uid] = _Outcome(refs[uid], self._failed("prepare", error))
        return pending

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

        def plan() -> list[PlannedDevice]:
            return plan_claim(
                ref,
                claim,
                driver=self.driver_name,
                pool=self.pool,
                devices=self.gate.devices_by_name(),
                ownership=self._ownership.current,
                health=self._health,
                why_missing=self._why_missing,
            )

        planned = await self._reserve(ref, plan)
        allocated_at = claim.allocation_timestamp if claim is not None else None
        return PendingClaim(ref=ref, planned=planned, existing=existing, allocated_at=allocated_at)

    async def _reserve(self, ref: ClaimRef, plan: Callable[[], list[PlannedDevice]]) -> list[PlannedDevice]:
        """Plan the claim and reserve its devices, waiting up to ``held_s`` for others to let go of
        them; planned again after a wait (the GPU's shape may have changed: its last MIG instance
        gone, MIG mode off, the whole GPU is the GPU again)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeouts.held_s
        while True:
            freed = self._reservations.freed  # taken before trying: a release in between wakes us
            planned = plan()
            try:
                self._reservations.reserve(ref, planned)
                return planned
            except InUse as exc:
                # only what prepared claims hold can come free while we wait; a claim of this
                # very call (or another in flight) keeps its reservation until the call is done
                if not exc.prepared or loop.time() >= deadline:
                    raise
                try:
                    async with asyncio.timeout_at(deadline):
                        await freed.wait()
                except TimeoutError:
                    raise ClaimError(
                        Reason.IN_USE, f"{exc} (still after {self._timeouts.held_s:g}s)", recoverable=True
                    ) from exc

    async def _write_specs(self, pending: list[PendingClaim]) -> dict[str, _Outcome]:
        """Write the CDI specs of the batch's new claims and record the ones that got theirs.

        When the specs' device names are known before writing (they are a function of the claim
        UID and its devices), the claims are recorded first and the checkpoint is written while
        the specs are, instead of after them: neither write needs the other, and the caller's
        persist then finds the checkpoint current. It is safe in either order of a crash: a
        checkpoint whose claim has no spec yet gets it from the CDI reconciler's first pass (and
        the kubelet, never answered, asks again and is given the stored answer); a spec without
        its claim in the checkpoint is an orphan the reconciler removes. A claim whose spec
        failed is taken out of memory again, and the caller's persist writes that down.
        """
        if not pending:
            return {}
        claims = {p.ref.uid: p.cdi_devices() for p in pending}
        expected = self._specs.names(claims)
        recorded: dict[str, PreparedClaim] = {}
        if expected is None:
            written = await self._specs.write(claims)
        else:
            now = self._now()
            for p in pending:
                recorded[p.ref.uid] = p.prepared(expected[p.ref.uid], now)
                self.prepared.record(recorded[p.ref.uid])
            written, _ = await asyncio.gather(self._specs.write(claims), self._persist_early())
        outcomes: dict[str, _Outcome] = {}
        unmade: list[str] = []
        for p in pending:
            names = written[p.ref.uid]
            if isinstance(names, CdiError):
                if expected is not None:  # recorded above: the claim is not prepared after all
                    self._unrecord(p)
                error = ClaimError(Reason.CDI_ERROR, f"writing the claim's CDI spec failed: {names}")
                outcomes[p.ref.uid] = _Outcome(p.ref, self._failed("prepare", error))
                if p.made and p.existing is None:
                    unmade.append(p.ref.uid)
                continue
            prepared = recorded.get(p.ref.uid)
            if prepared is None or expected is None or names != expected[p.ref.uid]:
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
        if unmade:
            await self.instances.destroy(unmade, quiet=True)
        return outcomes

    async def _persist_early(self) -> None:
        """The checkpoint written alongside the specs; a failure is the caller's persist's to act on
        (it writes again, and undoes the batch if that fails too)."""
        with contextlib.suppress(CheckpointError):  # logged by persist
            await self.prepared.persist()

    def _unrecord(self, p: PendingClaim) -> None:
        """Take a claim recorded before its spec was written out of memory again."""
        if p.existing is not None:
            self.prepared.record(p.existing)
        else:
            self.prepared.remove(p.ref.uid)

    def _why_missing(self, name: str) -> str:
        """Why a device name is not published now: its GPU is changing mode, or is published otherwise."""
        minor = name.removeprefix("gpu-").partition("-")[0]
        for gpu in self._inventory.current.gpus:
            if str(gpu.minor) == minor:
                mode = self.gate.modes().get(gpu.uuid)
                if mode is not None:
                    detail = mode.note or f"GPU {gpu.index} is published {mode.label}"
                    return f"GPU {gpu.index} publish mode {mode.label}: {detail}"
        return ""

    def gpu_of_device(self, name: str) -> str | None:
        """The physical GPU behind one of this node's DRA device names (None: not a device of ours).

        A name the node publishes now resolves through the mode gate; one from an older slice (a
        partition or share of a GPU whose publish mode changed since) by its ``gpu-<minor>`` prefix.
        """
        device = self.gate.devices_by_name().get(name)
        if device is not None:
            return device.gpu_uuid
        head, _, _ = name.partition("-mig-") if "-mig-" in name else name.partition("-shared")
        if not head.startswith("gpu-") or not head[4:].isdecimal():
            return None
        minor = int(head[4:])
        return next((gpu.uuid for gpu in self._inventory.current.gpus if gpu.minor == minor), None)

    def claim_source_state(self) -> dict[str, object]:
        """The claim source's own figures (the read-ahead's), if it keeps any."""
        state = getattr(self._claims, "debug_state", None)
        return state() if callable(state) else {}

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
        unmade: list[str] = []
        for outcome in outcomes:  # memory first, before any await: no later write may record them
            assert outcome.new is not None
            uid = outcome.new.uid
            if outcome.replaced is not None:
                self.prepared.record(outcome.replaced)
            else:
                self.prepared.remove(uid)
                undone.append(uid)
                if self.prepared.instances_of(uid):
                    unmade.append(uid)
            outcome.new = None
            outcome.answer = self._failed("prepare", error)
        if undone:
            await self._specs.discard(undone)
        if unmade:  # the records of the instances stay on disk until destroyed: a restart collects them
            await self.instances.destroy(unmade, quiet=True)

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
            with_instances = [
                r.uid for r in held if removed_specs.get(r.uid) is None and self.prepared.instances_of(r.uid)
            ]
            destroyed = await self.instances.destroy(with_instances) if with_instances else {}
            removed: list[PreparedClaim] = []
            for ref in held:
                if destroyed.get(ref.uid):
                    self._keep_partly_destroyed(ref.uid)
                    error = ClaimError(Reason.MIG_ERROR, destroyed[ref.uid])
                    errors[ref.uid] = self._failed("unprepare", error).error
                    continue
                errors[ref.uid] = self._forget(ref, removed_specs.get(ref.uid), removed)
            if not removed and with_instances:
                with contextlib.suppress(CheckpointError):  # logged; what it would write is retried
                    await self.prepared.persist()
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
            await self.shares.release_unused(self._mps_gpus().__contains__)
            self.gate.refresh()
            if removed or with_instances:
                self._reservations.let_go()
        now = time.perf_counter()
        for _ in refs:  # every claim of a call is answered when the call is
            self._metrics.claim_seconds.labels(operation="unprepare").observe(now - started)
        self._metrics.prepared.set(len(self.prepared))
        return errors

    def _keep_partly_destroyed(self, uid: str) -> None:
        """A claim some of whose MIG instances would not go: it stays prepared with the devices
        whose instances still exist (they keep their placements held), marked incomplete, so a
        Prepare of it plans again (making what is gone) instead of answering with a gone instance."""
        claim = self.prepared.get(uid)
        if claim is None:
            return
        alive = {(r.gpu_uuid, r.placement) for r in self.prepared.instances_of(uid)}
        devices = tuple(d for d in claim.devices if d.placement is None or (d.gpu_uuid, d.placement) in alive)
        self.prepared.record(dataclasses.replace(claim, devices=devices, complete=False))

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


def _who(claim: PreparedClaim) -> str:
    """A claim as a waiting note names it: namespace/name, or its UID when only that is known."""
    return f"{claim.namespace}/{claim.name}" if claim.complete else claim.uid
