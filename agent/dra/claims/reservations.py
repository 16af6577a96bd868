"""Devices reserved by claims whose preparation is in flight.

A claim's devices are reserved between the decision to prepare it and its record among the
prepared claims, so that claims prepared concurrently, in one call or in several, never get the
same device: :meth:`Reservations.reserve` checks every device against the prepared claims and
the other reservations and reserves them with no ``await`` in between (atomic on the loop).

Sharing rule: a device (or a whole GPU and anything on it) is held by at most one claim
*without* admin access; claims with admin access (monitoring, which the scheduler allocates on
devices in use) may share a device with any other claim. Two MIG partitions of one GPU may be
held at once when their placements (memory slices) do not overlap. Shares of a shared GPU may be
held together as long as the memory allocated to them adds up to no more than the GPU's
capacity; a share and anything but another share never sit on one GPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from agent.core.inventory.model import MigPlacement
from agent.dra.claims.checkpoint import CreatedInstance, PreparedClaim, PreparedDevice
from agent.dra.claims.errors import ClaimError, Reason
from agent.dra.claims.plan import PlannedDevice
from agent.kube.claims.model import ClaimRef


class InUse(ClaimError):
    """A device is held by another claim; ``prepared``: only by prepared claims (or instances still
    being destroyed), which an unprepare may let go of soon, not by claims in the same call."""

    def __init__(self, message: str, *, prepared: bool) -> None:
        super().__init__(Reason.IN_USE, message)
        self.prepared = prepared


@dataclass(frozen=True, slots=True)
class _Hold:
    """What one held device occupies of its GPU."""

    uuid: str
    gpu: str
    #: "whole" (the GPU), "mig" (a MIG device that existed), "partition" (an instance-backed
    #: device, with its placement), "share" (with its memory)
    kind: str
    admin: bool
    placement: MigPlacement | None = None
    memory: int = 0
    #: a share's GPU capacity (planned shares know it)
    capacity: int | None = None

    @classmethod
    def of(cls, device: PreparedDevice | PlannedDevice) -> _Hold:
        if isinstance(device, PreparedDevice):
            if device.share_memory is not None:
                return cls(device.uuid, device.gpu_uuid, "share", device.admin_access, memory=device.share_memory)
            if device.placement is not None:
                return cls(device.uuid, device.gpu_uuid, "partition", device.admin_access, device.placement)
            return cls(device.uuid, device.gpu_uuid, "mig" if device.is_mig else "whole", device.admin_access)
        d, admin = device.device, device.result.admin_access
        if device.share_memory is not None:
            capacity = d.share.memory if d.share is not None else None
            return cls(d.uuid, d.gpu_uuid, "share", admin, memory=device.share_memory, capacity=capacity)
        if d.partition is not None:
            return cls(d.uuid, d.gpu_uuid, "partition", admin, d.partition.placement)
        return cls(d.uuid, d.gpu_uuid, "mig" if d.is_mig else "whole", admin)

    def conflicts(self, other: _Hold) -> bool:
        """Whether the two share hardware they may not share (memory of shares is summed apart)."""
        if self.gpu != other.gpu or self.admin or other.admin:
            return False
        kinds = {self.kind, other.kind}
        if kinds == {"share"}:
            return False
        if kinds == {"partition"}:
            assert self.placement is not None and other.placement is not None
            return self.placement.overlaps(other.placement)
        if kinds == {"mig"}:
            return self.uuid == other.uuid
        return True


class Reservations:
    def __init__(
        self,
        prepared: Mapping[str, PreparedClaim],
        instances: Callable[[], Iterable[CreatedInstance]] = tuple,
    ) -> None:
        self._prepared = prepared
        #: the MIG instances the agent made (or is making): one being destroyed still takes its slices
        self._instances = instances
        #: claim UID -> its reference and the devices it reserved
        self._reserved: dict[str, tuple[ClaimRef, list[PlannedDevice]]] = {}
        #: moves with every reservation and release (the mode gate's "did anything change?")
        self.version = 0
        #: set (and replaced) whenever held devices may have been let go: a release here, or an
        #: unprepare (:meth:`let_go`); a claim waiting for a device waits on it
        self.freed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._reserved)

    def in_preparation(self) -> list[tuple[ClaimRef, list[PlannedDevice]]]:
        """Claims whose devices are reserved while their preparation is in flight."""
        return list(self._reserved.values())

    def reserve(self, ref: ClaimRef, planned: list[PlannedDevice]) -> None:
        """Check every device is free and reserve them; ClaimError (in use) when one is not."""
        held: dict[str, list[tuple[str, _Hold]]] = {}
        for uid, claim in self._prepared.items():
            if uid != ref.uid:
                for device in claim.devices:
                    held.setdefault(device.gpu_uuid, []).append((uid, _Hold.of(device)))
        for uid, (_, reserved) in self._reserved.items():
            for p in reserved:
                held.setdefault(p.device.gpu_uuid, []).append((uid, _Hold.of(p)))
        # an instance this claim already has where it wants one is its own (made again: adopted)
        wanted = {
            (p.device.gpu_uuid, p.device.partition.placement, p.device.partition.profile_id)
            for p in planned
            if p.device.partition
        }
        for record in self._instances():
            own = (record.gpu_uuid, record.placement, record.profile_id) in wanted
            if record.claim_uid != ref.uid or not own:
                hold = _Hold(record.uuid or "", record.gpu_uuid, "partition", False, record.placement)
                held.setdefault(record.gpu_uuid, []).append((record.claim_uid, hold))
        mine: list[_Hold] = []
        for p in planned:
            hold = _Hold.of(p)
            for uid, other in held.get(hold.gpu, ()):
                if hold.conflicts(other):
                    raise InUse(
                        f"device {p.device.name} is already {self._holder(uid)} "
                        f"({'GPU ' + other.gpu if other.uuid != hold.uuid else other.uuid})",
                        prepared=uid not in self._reserved,
                    )
            if hold.kind == "partition" and any(m.kind == "partition" and hold.conflicts(m) for m in mine):
                # one claim may name a device twice (one CDI device), never two overlapping instances
                raise ClaimError(Reason.IN_USE, f"device {p.device.name} overlaps another MIG partition of the claim")
            mine.append(hold)
        self._check_memory(mine, held)
        self._reserved[ref.uid] = (ref, planned)
        self.version += 1

    def _check_memory(self, mine: list[_Hold], held: dict[str, list[tuple[str, _Hold]]]) -> None:
        """The shares on a GPU never add up to more memory than it has."""
        for gpu in {h.gpu for h in mine if h.kind == "share" and not h.admin}:
            capacity = min(h.capacity for h in mine if h.gpu == gpu and h.capacity is not None)
            asked = sum(h.memory for h in mine if h.gpu == gpu and h.kind == "share" and not h.admin)
            shares = [(uid, h.memory) for uid, h in held.get(gpu, ()) if h.kind == "share" and not h.admin]
            taken = sum(memory for _, memory in shares)
            if taken + asked > capacity:
                prepared = sum(memory for uid, memory in shares if uid not in self._reserved)
                raise InUse(
                    f"GPU {gpu}: shares of {taken} bytes are prepared already; "
                    f"{asked} more exceed its {capacity} bytes",
                    prepared=prepared + asked > capacity,
                )

    def release(self, uid: str) -> None:
        """Drop the claim's reservation (it is prepared now, or failed); idempotent."""
        if self._reserved.pop(uid, None) is not None:
            self.version += 1
            self.let_go()

    def let_go(self) -> None:
        """Devices may be free now: wake the claims waiting for one."""
        self.freed.set()
        self.freed = asyncio.Event()

    def _holder(self, uid: str) -> str:
        claim = self._prepared.get(uid)
        if claim is None and uid not in self._reserved:
            return f"held by a MIG instance the agent made for claim {uid}, not destroyed yet"
        if claim is None:
            return f"being prepared for claim {uid}"
        name = f"{claim.namespace}/{claim.name} " if claim.complete else ""
        return f"prepared for claim {name}({uid})"
