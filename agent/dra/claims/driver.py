"""Claim preparation: the domain behind NodePrepareResources and NodeUnprepareResources.

:class:`DraDriver` owns the prepared claims (the one copy in memory, and the checkpoint on
disk). The servicers call :meth:`DraDriver.prepare` and :meth:`DraDriver.unprepare` with the
kubelet's claim references and translate the answers; nothing here knows gRPC.

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

Device sharing rule: a device (or a whole GPU and its MIG devices) is held by at most one
claim *without* admin access; claims with admin access (monitoring, which the scheduler
allocates on devices in use) may share a device with any other claim.

The work of a call runs in its own task, shielded from the call: a kubelet that gives up
(deadline, restart) does not cut a preparation in half; the claim ends up prepared and
checkpointed and the kubelet's retry gets the stored answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import structlog

from agent.base.errors import AgentError
from agent.cdi.claimenv import ClaimDevices
from agent.cdi.errors import CdiError
from agent.cdi.names import check_claim_uid
from agent.cdi.service import CdiProvider
from agent.core.inventory.model import Inventory
from agent.core.node import NodeFacts
from agent.dra.claims.checkpoint import VERSION as CHECKPOINT_VERSION
from agent.dra.claims.checkpoint import CheckpointError, CheckpointStore, PreparedClaim, PreparedDevice, utc_now
from agent.dra.claims.errors import ClaimError, Reason, quote
from agent.dra.claims.plan import PlannedDevice, plan_claim
from agent.dra.claims.specs import read_claim_specs, rebuild_claims
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


@dataclass(frozen=True, slots=True)
class _Pending:
    """A claim whose devices are reserved and whose CDI spec is still to be written."""

    ref: ClaimRef
    planned: list[PlannedDevice]
    existing: PreparedClaim | None
    #: the claim's status.allocation.allocationTimestamp, when the cluster sets it
    allocated_at: str | None = None

    def uuids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.device.uuid for p in self.planned))

    def cdi_devices(self) -> ClaimDevices:
        env = {p.device.uuid: tuple(f"{k}={v}" for k, v in p.env.items()) for p in self.planned}
        return ClaimDevices(devices=self.uuids(), env=env)

    def prepared(self, cdi_names: list[str], now: str) -> PreparedClaim:
        cdi = dict(zip(self.uuids(), cdi_names, strict=True))
        return PreparedClaim(
            namespace=self.ref.namespace,
            name=self.ref.name,
            uid=self.ref.uid,
            devices=tuple(_as_prepared(p, cdi_ids=(cdi[p.device.uuid],)) for p in self.planned),
            prepared_at=self.existing.prepared_at if self.existing is not None else now,
        )


@dataclass(slots=True)
class CheckpointStatus:
    """What ``/debug/state`` shows of the checkpoint."""

    path: Path
    version: int = 0
    loaded: str = ""  # "missing" (first start), "ok", "corrupt"
    loaded_boot_id: str = ""
    from_earlier_boot: bool = False
    last_write: str = ""
    last_error: str = ""
    writes: int = 0
    corrupt: dict[str, str] = field(default_factory=dict)
    rebuilt_claims: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "path": str(self.path),
            "version": self.version,
            "loaded": self.loaded,
            "loaded_boot_id": self.loaded_boot_id,
            "from_earlier_boot": self.from_earlier_boot,
            "last_write": self.last_write,
            "last_error": self.last_error,
            "writes": self.writes,
            "corrupt_moved_aside": dict(self.corrupt),
            "rebuilt_claims": self.rebuilt_claims,
        }


def _conflicts(a: PreparedDevice | PlannedDevice, b: PreparedDevice) -> bool:
    """Whether two holdings share hardware: one device, or a whole GPU and anything on it."""
    a_uuid, a_gpu, a_mig, a_admin = _holding(a)
    if a_gpu != b.gpu_uuid or a_admin or b.admin_access:
        return False
    return a_uuid == b.uuid or not a_mig or not b.is_mig


def _holding(item: PreparedDevice | PlannedDevice) -> tuple[str, str, bool, bool]:
    if isinstance(item, PreparedDevice):
        return item.uuid, item.gpu_uuid, item.is_mig, item.admin_access
    return item.device.uuid, item.device.gpu_uuid, item.device.is_mig, item.result.admin_access


class DraDriver:
    def __init__(
        self,
        *,
        driver_name: str,
        pool: str,
        claims: ClaimSource,
        node: NodeFacts,
        cdi: CdiProvider,
        store: CheckpointStore,
        metrics: DraMetrics,
        boot_id: str,
        cdi_root: Path | None = None,
        claim_kind: str = "",
        timeouts: PrepareTimeouts = DEFAULT_PREPARE_TIMEOUTS,
        now: Callable[[], str] = utc_now,
    ) -> None:
        self.driver_name = driver_name
        self.pool = pool
        self._claims = claims
        self._inventory = node.inventory
        self._ownership = node.ownership
        self._health = node.health
        self._cdi = cdi
        self._store = store
        self._metrics = metrics
        self._boot_id = boot_id
        self._cdi_root = cdi_root
        self._claim_kind = claim_kind
        self._timeouts = timeouts
        self._now = now
        self._prepared: dict[str, PreparedClaim] = {}
        #: claim UID -> devices it reserved while its preparation is in flight
        self._reserved: dict[str, list[PlannedDevice]] = {}
        #: claim UID -> its reference, for the claims in ``_reserved``
        self._reserving: dict[str, ClaimRef] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._lock_users: dict[str, int] = {}
        self._write_lock = asyncio.Lock()
        self._version = 0  # bumped by every change of _prepared
        self._written = 0  # the version the checkpoint on disk holds
        self._inflight: set[asyncio.Task[object]] = set()
        self.loaded = False
        #: why the checkpoint could not be loaded ("" once it is)
        self.load_error = ""
        self.checkpoint = CheckpointStatus(path=store.path)
        self._devices: tuple[Inventory | None, dict[str, DraDevice]] = (None, {})

    # --- reads ------------------------------------------------------------------------------

    @property
    def prepared(self) -> Mapping[str, PreparedClaim]:
        return self._prepared

    def in_preparation(self) -> list[tuple[ClaimRef, list[PlannedDevice]]]:
        """Claims whose devices are reserved while their preparation is in flight."""
        return [(self._reserving[uid], planned) for uid, planned in self._reserved.items() if uid in self._reserving]

    def cdi_claims(self) -> dict[str, ClaimDevices] | None:
        """Which claim specs the CDI reconciler must keep (and re-create when missing); None
        while the checkpoint is not loaded (every claim spec on disk is kept then)."""
        if not self.loaded:
            return None
        out = {}
        for uid, claim in self._prepared.items():
            env: dict[str, tuple[str, ...]] = {}
            for device in claim.devices:
                env.setdefault(device.uuid, tuple(f"{k}={v}" for k, v in device.env.items()))
            out[uid] = ClaimDevices(devices=tuple(dict.fromkeys(d.uuid for d in claim.devices)), env=env)
        return out

    # --- start ------------------------------------------------------------------------------

    async def restore(self) -> None:
        """Load the checkpoint (or rebuild it from the CDI claim specs); once, before serving.

        Raises StartupError only when the state directory cannot be read at all.
        """
        loaded = await asyncio.to_thread(self._store.load)
        status = self.checkpoint
        status.loaded, status.loaded_boot_id = loaded.status, loaded.boot_id
        claims = loaded.claims
        if loaded.status == "corrupt":
            self._metrics.checkpoint_corruptions.inc()
            status.corrupt = {"problem": loaded.problem, "moved_to": str(loaded.moved_to), "at": self._now()}
            claims = await asyncio.to_thread(self._rebuild)
            status.rebuilt_claims = len(claims)
            log.error(
                "dra.checkpoint_rebuilt",
                problem=loaded.problem,
                moved_to=str(loaded.moved_to),
                claims=len(claims),
                source="CDI claim specs",
            )
        elif loaded.status == "ok" and loaded.boot_id and self._boot_id and loaded.boot_id != self._boot_id:
            # Nothing prepared before a reboot is still running, but the kubelet's own checkpoint
            # still lists the claims: it prepares them again (same answer) or unprepares them
            # (cleans up). So the entries stay, and their CDI specs are re-created.
            status.from_earlier_boot = True
            log.info("dra.checkpoint_from_earlier_boot", claims=len(claims), written_under=loaded.boot_id)
        self._prepared = dict(claims)
        self._version = 1 if loaded.status == "corrupt" else 0
        status.version = CHECKPOINT_VERSION if loaded.status == "ok" else 0
        self.loaded = True
        self.load_error = ""
        self._metrics.prepared.set(len(self._prepared))
        log.info("dra.checkpoint_loaded", status=loaded.status, claims=len(self._prepared), path=str(self._store.path))
        if loaded.status == "corrupt":
            try:
                await self._persist()
            except CheckpointError as exc:
                log.error("dra.checkpoint_rebuild_not_written", error=str(exc))

    def _rebuild(self) -> dict[str, PreparedClaim]:
        if self._cdi_root is None or not self._claim_kind:
            return {}
        specs = read_claim_specs(self._cdi_root, self._claim_kind)
        return rebuild_claims(specs, dra_devices(self._inventory.current), pool=self.pool, now=self._now())

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
        async with self._claim_locks(refs) as (held, busy):
            for ref in busy:
                answers[ref.uid] = self._failed("prepare", self._busy_error(ref))
            # 1. per claim, concurrently: the stored answer, or read, decide and reserve
            firsts = await asyncio.gather(*(self._plan_one(ref) for ref in held))
            outcomes = {o.ref.uid: o for o in firsts if isinstance(o, _Outcome)}
            pending = [p for p in firsts if isinstance(p, _Pending)]
            # 2. the batch's CDI specs in one go; 3. one checkpoint write for the batch
            try:
                outcomes.update(await self._write_specs(pending))
            finally:
                for p in pending:
                    self._reserved.pop(p.ref.uid, None)
                    self._reserving.pop(p.ref.uid, None)
            new = [o for o in outcomes.values() if o.new is not None]
            if new:
                try:
                    await self._persist()
                except CheckpointError as exc:
                    await self._undo_prepare(new, exc)
            self._metrics.prepares.labels(result="prepared").inc(sum(1 for o in outcomes.values() if o.new))
            for ref in held:
                answers[ref.uid] = outcomes[ref.uid].answer
        now = time.perf_counter()
        for _ in refs:  # every claim of a call is answered when the call is
            self._metrics.claim_seconds.labels(operation="prepare").observe(now - started)
        self._metrics.prepared.set(len(self._prepared))
        return answers

    async def _plan_one(self, ref: ClaimRef) -> _Outcome | _Pending:
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

    async def _plan_claim(self, ref: ClaimRef) -> _Outcome | _Pending:
        existing = self._prepared.get(ref.uid)
        if existing is not None and existing.complete:
            self._metrics.prepares.labels(result="already-prepared").inc()
            return _Outcome(ref, answer_of(existing))
        _check_ref(ref)
        if existing is None and len(self._prepared) + len(self._reserved) >= MAX_PREPARED:
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
        self._reserve(ref, planned)
        allocated_at = claim.allocation_timestamp if claim is not None else None
        return _Pending(ref=ref, planned=planned, existing=existing, allocated_at=allocated_at)

    async def _write_specs(self, pending: list[_Pending]) -> dict[str, _Outcome]:
        """Write the CDI specs of the batch's new claims and record the ones that got theirs."""
        if not pending:
            return {}
        try:
            written = await self._cdi.prepare_claims({p.ref.uid: p.cdi_devices() for p in pending})
        except CdiError as exc:
            written = dict.fromkeys((p.ref.uid for p in pending), exc)
        outcomes: dict[str, _Outcome] = {}
        for p in pending:
            names = written.get(p.ref.uid, CdiError("the CDI service gave no answer for this claim"))
            if isinstance(names, CdiError):
                error = ClaimError(Reason.CDI_ERROR, f"writing the claim's CDI spec failed: {names}")
                outcomes[p.ref.uid] = _Outcome(p.ref, self._failed("prepare", error))
                continue
            prepared = p.prepared(names, self._now())
            self._prepared[p.ref.uid] = prepared
            self._version += 1
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

    def _reserve(self, ref: ClaimRef, planned: list[PlannedDevice]) -> None:
        """Check every device is free and reserve them, with no await in between (atomic on the loop)."""
        held: dict[str, list[tuple[str, PreparedDevice]]] = {}
        for uid, claim in self._prepared.items():
            if uid != ref.uid:
                for device in claim.devices:
                    held.setdefault(device.gpu_uuid, []).append((uid, device))
        for uid, reserved in self._reserved.items():
            for p in reserved:
                held.setdefault(p.device.gpu_uuid, []).append((uid, _as_prepared(p)))
        for p in planned:
            for uid, other in held.get(p.device.gpu_uuid, ()):
                if _conflicts(p, other):
                    raise ClaimError(
                        Reason.IN_USE,
                        f"device {p.device.name} is already {self._holder(uid)} "
                        f"({'GPU ' + other.gpu_uuid if other.uuid != p.device.uuid else other.uuid})",
                    )
        self._reserved[ref.uid] = planned
        self._reserving[ref.uid] = ref

    def _holder(self, uid: str) -> str:
        claim = self._prepared.get(uid)
        if claim is None:
            return f"being prepared for claim {uid}"
        name = f"{claim.namespace}/{claim.name} " if claim.complete else ""
        return f"prepared for claim {name}({uid})"

    async def _undo_prepare(self, outcomes: list[_Outcome], exc: CheckpointError) -> None:
        """The checkpoint did not record this batch: its new claims are not prepared after all."""
        error = ClaimError(Reason.CHECKPOINT_ERROR, f"recording the claim in the checkpoint failed: {exc}")
        undone: list[str] = []
        for outcome in outcomes:  # memory first, before any await: no later write may record them
            assert outcome.new is not None
            uid = outcome.new.uid
            if outcome.replaced is not None:
                self._prepared[uid] = outcome.replaced
            else:
                self._prepared.pop(uid, None)
                undone.append(uid)
            self._version += 1
            outcome.new = None
            outcome.answer = self._failed("prepare", error)
        if undone:
            with contextlib.suppress(CdiError):  # a spec left behind is an orphan the CDI reconciler removes
                await self._cdi.unprepare_claims(undone)

    # --- unprepare --------------------------------------------------------------------------

    async def _unprepare_batch(self, refs: list[ClaimRef]) -> dict[str, str]:
        if len(refs) > MAX_BATCH:
            message = f"{len(refs)} claims in one call, at most {MAX_BATCH}"
            return {r.uid: self._failed("unprepare", ClaimError(Reason.BAD_REQUEST, message)).error for r in refs}
        started = time.perf_counter()
        errors: dict[str, str] = {}
        async with self._claim_locks(refs) as (held, busy):
            for ref in busy:
                errors[ref.uid] = self._failed("unprepare", self._busy_error(ref)).error
            # a UID CDI refuses never had a spec, and no claim was ever prepared under it
            valid = [r.uid for r in held if _cdi_uid_ok(r.uid)]
            removed_specs = await self._cdi.unprepare_claims(valid) if valid else {}
            removed: list[PreparedClaim] = []
            for ref in held:
                errors[ref.uid] = self._forget(ref, removed_specs.get(ref.uid), removed)
            if removed:
                try:
                    await self._persist()
                except CheckpointError as exc:
                    message = f"removing the claim from the checkpoint failed: {exc}"
                    for claim in removed:  # still recorded on disk: keep them, the kubelet retries
                        self._prepared[claim.uid] = claim
                        self._version += 1
                        errors[claim.uid] = self._failed(
                            "unprepare", ClaimError(Reason.CHECKPOINT_ERROR, message)
                        ).error
                else:
                    self._metrics.unprepares.labels(result="unprepared").inc(len(removed))
        now = time.perf_counter()
        for _ in refs:  # every claim of a call is answered when the call is
            self._metrics.claim_seconds.labels(operation="unprepare").observe(now - started)
        self._metrics.prepared.set(len(self._prepared))
        return errors

    def _forget(self, ref: ClaimRef, spec_error: CdiError | None, removed: list[PreparedClaim]) -> str:
        """Drop the claim from memory once its CDI spec is gone; its error text, or ""."""
        if spec_error is not None:
            error = ClaimError(Reason.CDI_ERROR, f"removing the claim's CDI spec failed: {spec_error}")
            return self._failed("unprepare", error).error
        existing = self._prepared.pop(ref.uid, None)
        if existing is None:
            self._metrics.unprepares.labels(result="not-prepared").inc()
            return ""
        self._version += 1
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

    @contextlib.asynccontextmanager
    async def _claim_locks(self, refs: list[ClaimRef]) -> AsyncIterator[tuple[list[ClaimRef], list[ClaimRef]]]:
        """Lock each claim of a call, in UID order (two calls never wait on each other in a
        circle), within one deadline; yields (claims locked, claims another call kept busy)."""
        held: list[ClaimRef] = []
        busy: list[ClaimRef] = []
        locks: list[str] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeouts.lock_s
        try:
            for ref in sorted(refs, key=lambda r: r.uid):
                lock = self._locks.setdefault(ref.uid, asyncio.Lock())
                self._lock_users[ref.uid] = self._lock_users.get(ref.uid, 0) + 1
                try:
                    async with asyncio.timeout_at(deadline):
                        await lock.acquire()
                except TimeoutError:
                    self._drop_lock(ref.uid)
                    busy.append(ref)
                    continue
                locks.append(ref.uid)
                held.append(ref)
            order = {r.uid: i for i, r in enumerate(refs)}
            held.sort(key=lambda r: order[r.uid])
            yield held, busy
        finally:
            for uid in locks:
                self._locks[uid].release()
                self._drop_lock(uid)

    def _drop_lock(self, uid: str) -> None:
        users = self._lock_users[uid] - 1
        if users:
            self._lock_users[uid] = users
        else:
            del self._lock_users[uid], self._locks[uid]

    async def _persist(self) -> None:
        """Write the checkpoint unless a write that already includes this change happened."""
        target = self._version
        async with self._write_lock:
            if self._written >= target:
                return
            version = self._version
            claims = list(self._prepared.values())
            try:
                written_at = await asyncio.to_thread(self._store.write, claims, boot_id=self._boot_id)
            except CheckpointError as exc:
                self._metrics.checkpoint_writes.labels(result="error").inc()
                self.checkpoint.last_error = str(exc)
                log.error("dra.checkpoint_write_failed", error=str(exc))
                raise
            self._written = version
            self.checkpoint.last_write, self.checkpoint.last_error = written_at, ""
            self.checkpoint.writes += 1
            self.checkpoint.version = CHECKPOINT_VERSION
            self._metrics.checkpoint_writes.labels(result="ok").inc()


def _as_prepared(p: PlannedDevice, *, cdi_ids: tuple[str, ...] = ()) -> PreparedDevice:
    """The checkpoint's record of a planned device (CDI IDs once its spec is written)."""
    return PreparedDevice(
        pool=p.result.pool,
        name=p.device.name,
        uuid=p.device.uuid,
        gpu_uuid=p.device.gpu_uuid,
        requests=(p.result.main_request,),
        share_id=p.result.share_id,
        cdi_ids=cdi_ids,
        env=dict(p.env),
        admin_access=p.result.admin_access,
    )


def _cdi_uid_ok(uid: str) -> bool:
    try:
        check_claim_uid(uid)
    except CdiError:
        return False
    return True


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
