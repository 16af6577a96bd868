"""The prepared claims: the one copy in memory, and the checkpoint that records it.

:class:`PreparedClaims` is a read-only mapping (claim UID -> :class:`PreparedClaim`) for everyone
who asks what DRA handed out, and the only place that changes it: :meth:`PreparedClaims.record`
and :meth:`PreparedClaims.remove`, called by the driver under the claim's lock. It also holds the
MIG instances the agent made (:meth:`PreparedClaims.record_instance`,
:meth:`PreparedClaims.drop_instance`), which the checkpoint records with the claims.

Every change bumps a version; :meth:`PreparedClaims.persist` writes the checkpoint unless a write
that already includes the change happened, so a batch costs one write (one fsync) and
concurrent batches share writes. :meth:`PreparedClaims.restore` loads it once, before serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from agent.dra.claims.checkpoint import VERSION as CHECKPOINT_VERSION
from agent.dra.claims.checkpoint import CheckpointError, CheckpointStore, CreatedInstance, PreparedClaim, utc_now
from agent.dra.metrics import DraMetrics

log = structlog.get_logger("agent.dra")


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


class PreparedClaims(Mapping[str, PreparedClaim]):
    def __init__(
        self,
        store: CheckpointStore,
        *,
        boot_id: str,
        metrics: DraMetrics,
        now: Callable[[], str] = utc_now,
    ) -> None:
        self._store = store
        self._boot_id = boot_id
        self._metrics = metrics
        self._now = now
        self._claims: dict[str, PreparedClaim] = {}
        #: (GPU UUID, first memory slice) -> the MIG instance the agent made or is making there
        self._instances: dict[tuple[str, int], CreatedInstance] = {}
        self._write_lock = asyncio.Lock()
        self._version = 0  # bumped by every change of _claims
        self._changes = 0  # likewise, and by a restore: never goes back
        self._written = 0  # the version the checkpoint on disk holds
        self.loaded = False
        #: why the checkpoint could not be loaded ("" once it is)
        self.load_error = ""
        self.checkpoint = CheckpointStatus(path=store.path)

    # --- the mapping ------------------------------------------------------------------------

    def __getitem__(self, uid: str) -> PreparedClaim:
        return self._claims[uid]

    def __iter__(self) -> Iterator[str]:
        return iter(self._claims)

    def __len__(self) -> int:
        return len(self._claims)

    def named(self, namespace: str, name: str) -> bool:
        """Whether a claim of that name is prepared (whatever its UID)."""
        return any(c.name == name and c.namespace == namespace for c in self._claims.values())

    # --- changes (the driver's, under the claim's lock) -------------------------------------

    def record(self, claim: PreparedClaim) -> None:
        """Add the claim, or replace its entry; the next :meth:`persist` writes it."""
        self._claims[claim.uid] = claim
        self._version += 1
        self._changes += 1

    def remove(self, uid: str) -> PreparedClaim | None:
        """Drop the claim's entry (the one removed, None when it had none)."""
        existing = self._claims.pop(uid, None)
        if existing is not None:
            self._version += 1
            self._changes += 1
        return existing

    @property
    def version(self) -> int:
        """Moves with every change of the claims or instances (cheap "did anything change?")."""
        return self._changes

    # --- MIG instances the agent made ---------------------------------------------------------

    @property
    def instances(self) -> tuple[CreatedInstance, ...]:
        return tuple(self._instances.values())

    def instances_of(self, claim_uid: str) -> list[CreatedInstance]:
        return [i for i in self._instances.values() if i.claim_uid == claim_uid]

    def record_instance(self, instance: CreatedInstance) -> None:
        """Record an instance about to be made (``uuid`` None) or made; the next persist writes it."""
        self._instances[(instance.gpu_uuid, instance.placement.start)] = instance
        self._version += 1
        self._changes += 1

    def drop_instance(self, instance: CreatedInstance) -> None:
        """Forget an instance that is gone (destroyed, or never made)."""
        key = (instance.gpu_uuid, instance.placement.start)
        if self._instances.get(key) == instance:
            del self._instances[key]
            self._version += 1
            self._changes += 1

    # --- the checkpoint ---------------------------------------------------------------------

    async def restore(self, rebuild: Callable[[], dict[str, PreparedClaim]]) -> None:
        """Load the checkpoint, or ``rebuild`` (blocking, run in a thread) when it is corrupt; once,
        before serving.

        Raises StartupError only when the state directory cannot be read at all.
        """
        loaded = await asyncio.to_thread(self._store.load)
        status = self.checkpoint
        status.loaded, status.loaded_boot_id = loaded.status, loaded.boot_id
        claims = loaded.claims
        if loaded.status == "corrupt":
            self._metrics.checkpoint_corruptions.inc()
            status.corrupt = {"problem": loaded.problem, "moved_to": str(loaded.moved_to), "at": self._now()}
            claims = await asyncio.to_thread(rebuild)
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
        self._claims = dict(claims)
        self._instances = {(i.gpu_uuid, i.placement.start): i for i in loaded.instances}
        self._version = 1 if loaded.status == "corrupt" else 0
        self._changes += 1
        status.version = CHECKPOINT_VERSION if loaded.status == "ok" else 0
        self.loaded = True
        self.load_error = ""
        self._metrics.prepared.set(len(self._claims))
        log.info("dra.checkpoint_loaded", status=loaded.status, claims=len(self._claims), path=str(self._store.path))
        if loaded.status == "corrupt":
            try:
                await self.persist()
            except CheckpointError as exc:
                log.error("dra.checkpoint_rebuild_not_written", error=str(exc))

    async def persist(self) -> None:
        """Write the checkpoint unless a write that already includes this change happened."""
        target = self._version
        async with self._write_lock:
            if self._written >= target:
                return
            version = self._version
            claims = list(self._claims.values())
            instances = list(self._instances.values())
            try:
                written_at = await asyncio.to_thread(
                    self._store.write, claims, boot_id=self._boot_id, instances=instances
                )
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
