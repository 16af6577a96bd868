"""Devices reserved by claims whose preparation is in flight.

A claim's devices are reserved between the decision to prepare it and its record among the
prepared claims, so that claims prepared concurrently, in one call or in several, never get the
same device: :meth:`Reservations.reserve` checks every device against the prepared claims and
the other reservations and reserves them with no ``await`` in between (atomic on the loop).

Sharing rule: a device (or a whole GPU and its MIG devices) is held by at most one claim
*without* admin access; claims with admin access (monitoring, which the scheduler allocates on
devices in use) may share a device with any other claim.
"""

from __future__ import annotations

from collections.abc import Mapping

from agent.dra.claims.checkpoint import PreparedClaim, PreparedDevice
from agent.dra.claims.errors import ClaimError, Reason
from agent.dra.claims.pending import as_prepared
from agent.dra.claims.plan import PlannedDevice
from agent.kube.claims.model import ClaimRef


class Reservations:
    def __init__(self, prepared: Mapping[str, PreparedClaim]) -> None:
        self._prepared = prepared
        #: claim UID -> its reference and the devices it reserved
        self._reserved: dict[str, tuple[ClaimRef, list[PlannedDevice]]] = {}

    def __len__(self) -> int:
        return len(self._reserved)

    def in_preparation(self) -> list[tuple[ClaimRef, list[PlannedDevice]]]:
        """Claims whose devices are reserved while their preparation is in flight."""
        return list(self._reserved.values())

    def reserve(self, ref: ClaimRef, planned: list[PlannedDevice]) -> None:
        """Check every device is free and reserve them; ClaimError (in use) when one is not."""
        held: dict[str, list[tuple[str, PreparedDevice]]] = {}
        for uid, claim in self._prepared.items():
            if uid != ref.uid:
                for device in claim.devices:
                    held.setdefault(device.gpu_uuid, []).append((uid, device))
        for uid, (_, reserved) in self._reserved.items():
            for p in reserved:
                held.setdefault(p.device.gpu_uuid, []).append((uid, as_prepared(p)))
        for p in planned:
            for uid, other in held.get(p.device.gpu_uuid, ()):
                if _conflicts(p, other):
                    raise ClaimError(
                        Reason.IN_USE,
                        f"device {p.device.name} is already {self._holder(uid)} "
                        f"({'GPU ' + other.gpu_uuid if other.uuid != p.device.uuid else other.uuid})",
                    )
        self._reserved[ref.uid] = (ref, planned)

    def release(self, uid: str) -> None:
        """Drop the claim's reservation (it is prepared now, or failed); idempotent."""
        self._reserved.pop(uid, None)

    def _holder(self, uid: str) -> str:
        claim = self._prepared.get(uid)
        if claim is None:
            return f"being prepared for claim {uid}"
        name = f"{claim.namespace}/{claim.name} " if claim.complete else ""
        return f"prepared for claim {name}({uid})"


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
