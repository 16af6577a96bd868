"""The MIG instances dynamic MIG makes for claims: made at prepare, destroyed at unprepare, and
after a restart, those no claim needs any more.

Crash safety rests on one rule: an instance is *recorded before it is made*
(:class:`~agent.dra.claims.checkpoint.CreatedInstance` with ``uuid`` None, written to the
checkpoint), and completed once it exists. So:

* a crash before the record is written leaves nothing made;
* a crash while an instance is made leaves a record naming its GPU, profile and placement: the
  restart looks for an instance exactly there and destroys it (no claim was answered with it);
* a crash after the claim was recorded leaves a prepared claim and its instance, as it should;
* an instance that no record names was not made by the agent and is never touched.

Making is all or nothing per claim: when one of a claim's instances cannot be made, the ones
already made for it are destroyed before the claim's error goes out. Calls to one GPU are made
one after the other (NVML changes one GPU's MIG layout at a time); different GPUs in parallel.
After instances appear or vanish the inventory is re-read (``reload``), so the CDI spec, health
and the slices see them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import TypeVar

import structlog

from agent.core.inventory.model import MigDevice
from agent.core.partitioning import MigControl, PartitionError, PartitionErrorKind
from agent.dra.claims.checkpoint import CheckpointError, CreatedInstance
from agent.dra.claims.errors import ClaimError, Reason
from agent.dra.claims.pending import PendingClaim
from agent.dra.claims.prepared import PreparedClaims

log = structlog.get_logger("agent.dra")

_T = TypeVar("_T", "_Job", CreatedInstance)
_R = TypeVar("_R")

Reload = Callable[[], Awaitable[None]]

#: one MIG call may take a few seconds on a busy GPU (NVIDIA measures GPU instance destroy at O(1 s))
CALL_TIMEOUT_S = 15.0


async def _no_reload() -> None:
    return None


@dataclass(frozen=True, slots=True)
class _Job:
    claim: PendingClaim
    index: int
    record: CreatedInstance


class InstanceMaker:
    def __init__(
        self,
        *,
        mig: MigControl,
        prepared: PreparedClaims,
        reload: Reload = _no_reload,
        call_timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        self._mig = mig
        self._prepared = prepared
        self._reload = reload
        self._timeout = call_timeout_s
        #: why the last restart clean-up left instances behind ("" when it did not)
        self.last_error = ""
        self.made = 0
        self.destroyed = 0

    def set_reload(self, reload: Reload) -> None:
        """How to re-read the inventory now (the composition root's; until then nothing is re-read)."""
        self._reload = reload

    # --- prepare ---------------------------------------------------------------------------

    async def make(self, pending: list[PendingClaim]) -> tuple[list[PendingClaim], dict[str, ClaimError]]:
        """The batch's claims with their instances made, and the claims whose instances could not be
        (nothing of theirs is left). Claims without partitions pass through untouched."""
        jobs: list[_Job] = []
        adopted: dict[str, dict[int, str]] = {}
        for claim in pending:
            mine = {(i.gpu_uuid, i.placement): i for i in self._prepared.instances_of(claim.ref.uid) if i.created}
            for index, planned in enumerate(claim.planned):
                partition = planned.device.partition
                if partition is None:
                    continue
                old = mine.get((planned.device.gpu_uuid, partition.placement))
                if old is not None and old.uuid is not None and old.profile_id == partition.profile_id:
                    adopted.setdefault(claim.ref.uid, {})[index] = old.uuid  # a claim completed again
                    continue
                record = CreatedInstance(
                    gpu_uuid=planned.device.gpu_uuid,
                    profile_id=partition.profile_id,
                    placement=partition.placement,
                    claim_uid=claim.ref.uid,
                )
                jobs.append(_Job(claim, index, record))
        if not jobs:
            return [replace(c, made=adopted[c.ref.uid]) if c.ref.uid in adopted else c for c in pending], {}
        for job in jobs:
            self._prepared.record_instance(job.record)
        try:
            await self._prepared.persist()  # recorded before made: a crash now leaves a record, not a stray
        except CheckpointError as exc:
            for job in jobs:
                self._prepared.drop_instance(job.record)
            error = ClaimError(Reason.CHECKPOINT_ERROR, f"recording the MIG instance to make failed: {exc}")
            refused = {job.claim.ref.uid: error for job in jobs}
            return [c for c in pending if c.ref.uid not in refused], refused
        outcomes = await self._run_per_gpu(jobs, self._make_one)
        made: dict[str, dict[int, str]] = {uid: dict(found) for uid, found in adopted.items()}
        failed: dict[str, ClaimError] = {}
        completed: list[CreatedInstance] = []
        for job, outcome in zip(jobs, outcomes, strict=True):
            uid = job.claim.ref.uid
            if isinstance(outcome, MigDevice):
                record = replace(
                    job.record,
                    uuid=outcome.uuid,
                    gpu_instance_id=outcome.gpu_instance_id,
                    compute_instance_id=outcome.compute_instance_id,
                )
                self._prepared.record_instance(record)
                completed.append(record)
                made.setdefault(uid, {})[job.index] = outcome.uuid
                self.made += 1
            else:
                self._prepared.drop_instance(job.record)
                failed.setdefault(uid, outcome)
        # never half-made: a failed claim's other instances go again before its error does
        await self._destroy_records([r for r in completed if r.claim_uid in failed], quiet=True)
        await self._reload()
        out = [replace(c, made=made.get(c.ref.uid, {})) for c in pending if c.ref.uid not in failed]
        return out, failed

    async def _make_one(self, job: _Job) -> MigDevice | ClaimError:
        planned = job.claim.planned[job.index]
        partition = planned.device.partition
        assert partition is not None
        what = (
            f"making MIG instance {partition.profile} at memory slices {partition.placement.start}-"
            f"{partition.placement.start + partition.placement.size - 1} of GPU {planned.device.gpu_uuid} "
            f"for device {planned.device.name}"
        )
        try:
            async with asyncio.timeout(self._timeout):
                device = await self._mig.create(planned.device.gpu_uuid, partition.profile_id, partition.placement)
        except PartitionError as exc:
            log.warning("dra.mig_create_failed", device=planned.device.name, kind=exc.kind.value, error=str(exc))
            return ClaimError(Reason.MIG_ERROR, f"{what} failed ({exc.kind.value}): {exc}")
        except TimeoutError:
            return ClaimError(Reason.MIG_ERROR, f"{what} took longer than {self._timeout:g}s")
        log.info("dra.mig_created", device=planned.device.name, uuid=device.uuid, claim_uid=job.claim.ref.uid)
        return device

    # --- unprepare and clean-up ----------------------------------------------------------------

    async def destroy(self, claim_uids: Iterable[str], *, quiet: bool = False) -> dict[str, str]:
        """Destroy the instances of these claims; claim UID -> error ("" when every one is gone).

        An instance already gone counts as destroyed; one that cannot be destroyed stays recorded
        (the kubelet's retry, or the next clean-up, tries again).
        """
        uids = list(dict.fromkeys(claim_uids))
        errors = dict.fromkeys(uids, "")
        records = [r for uid in uids for r in self._prepared.instances_of(uid)]
        if records:
            errors.update(await self._destroy_records(records, quiet=quiet))
            await self._reload()
        return errors

    async def _destroy_records(self, records: list[CreatedInstance], *, quiet: bool) -> dict[str, str]:
        errors: dict[str, str] = {}
        outcomes = await self._run_per_gpu(records, self._destroy_one) if records else []
        for record, outcome in zip(records, outcomes, strict=True):
            if outcome:
                errors[record.claim_uid] = errors.get(record.claim_uid) or outcome
                if not quiet:
                    log.warning("dra.mig_destroy_failed", claim_uid=record.claim_uid, error=outcome)
            else:
                self._prepared.drop_instance(record)
                self.destroyed += 1
        return errors

    async def _destroy_one(self, record: CreatedInstance) -> str:
        try:
            async with asyncio.timeout(self._timeout):
                if record.gpu_instance_id is None or record.compute_instance_id is None:
                    found = await self._find(record)
                    if found is None:
                        return ""  # the creation the record announced never happened
                    gi, ci = found.gpu_instance_id, found.compute_instance_id
                else:
                    gi, ci = record.gpu_instance_id, record.compute_instance_id
                await self._mig.destroy(record.gpu_uuid, gi, ci)
        except PartitionError as exc:
            if exc.kind is PartitionErrorKind.NOT_FOUND:
                return ""
            what = f"destroying MIG instance {record.uuid or '(being made)'} on GPU {record.gpu_uuid}"
            return f"{what} failed ({exc.kind.value}): {exc}"
        except TimeoutError:
            return f"destroying MIG instance {record.uuid} on GPU {record.gpu_uuid} took longer than {self._timeout:g}s"
        log.info("dra.mig_destroyed", uuid=record.uuid, gpu=record.gpu_uuid, claim_uid=record.claim_uid)
        return ""

    async def _find(self, record: CreatedInstance) -> MigDevice | None:
        """The instance a record made before its creation was confirmed: exactly its profile at its placement."""
        for device in await self._mig.instances(record.gpu_uuid):
            if device.placement == record.placement and device.profile_id in (None, record.profile_id):
                return device
        return None

    async def collect(self, needed: Callable[[str], bool]) -> int:
        """Destroy every recorded instance whose claim ``needed`` says no to; how many were left behind.

        Run at start (after the checkpoint is loaded) and after unprepares. Never touches an
        instance the records do not name.
        """
        unneeded = sorted({r.claim_uid for r in self._prepared.instances if not needed(r.claim_uid)})
        if not unneeded:
            return 0
        log.info("dra.mig_collect", claims=len(unneeded))
        await self._forget_vanished([r for r in self._prepared.instances if r.claim_uid in unneeded])
        errors = await self.destroy(unneeded, quiet=False)
        left = [e for e in errors.values() if e]
        self.last_error = left[0] if left else ""
        try:
            await self._prepared.persist()
        except CheckpointError as exc:
            log.error("dra.mig_collect_not_written", error=str(exc))
        return len(left)

    async def _forget_vanished(self, records: list[CreatedInstance]) -> None:
        """Drop the records of completed instances that no longer exist (someone destroyed them):
        their IDs may name another's instance by now, which must never be destroyed."""
        for gpu in sorted({r.gpu_uuid for r in records if r.created}):
            try:
                async with asyncio.timeout(self._timeout):
                    there = {d.uuid for d in await self._mig.instances(gpu)}
            except (PartitionError, TimeoutError) as exc:
                log.warning("dra.mig_list_failed", gpu=gpu, error=str(exc))
                continue
            for record in records:
                if record.gpu_uuid == gpu and record.created and record.uuid not in there:
                    log.info("dra.mig_vanished", uuid=record.uuid, gpu=gpu, claim_uid=record.claim_uid)
                    self._prepared.drop_instance(record)

    async def _run_per_gpu(self, items: list[_T], call: Callable[[_T], Awaitable[_R]]) -> list[_R]:
        """``call`` for each item, one GPU's items in order, GPUs in parallel; results in item order."""
        by_gpu: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            by_gpu.setdefault(_gpu_of(item), []).append(i)
        results: dict[int, _R] = {}

        async def one_gpu(indexes: list[int]) -> None:
            for i in indexes:
                results[i] = await call(items[i])

        async with asyncio.TaskGroup() as group:
            for indexes in by_gpu.values():
                group.create_task(one_gpu(indexes))
        return [results[i] for i in range(len(items))]

    def debug_state(self) -> dict[str, object]:
        return {
            "made": self.made,
            "destroyed": self.destroyed,
            "recorded": [
                {
                    "gpu": i.gpu_uuid,
                    "profile_id": i.profile_id,
                    "placement": [i.placement.start, i.placement.size],
                    "claim_uid": i.claim_uid,
                    "uuid": i.uuid,
                }
                for i in self._prepared.instances
            ],
            "last_error": self.last_error or None,
        }


def _gpu_of(item: _Job | CreatedInstance) -> str:
    return item.record.gpu_uuid if isinstance(item, _Job) else item.gpu_uuid
