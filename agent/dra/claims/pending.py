"""A claim between its plan and its record: devices reserved, CDI spec still to be written.

:class:`PendingClaim` is what one preparation carries from step 1 (read, decide, reserve) to
step 2 (the batch's CDI specs) of :class:`~agent.dra.claims.driver.DraDriver`; once its spec is
written, :meth:`PendingClaim.prepared` is the checkpoint entry it becomes. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.cdi.claimenv import ClaimDevices
from agent.dra.claims.checkpoint import PreparedClaim, PreparedDevice
from agent.dra.claims.plan import PlannedDevice
from agent.kube.claims.model import ClaimRef


@dataclass(frozen=True, slots=True)
class PendingClaim:
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
            devices=tuple(as_prepared(p, cdi_ids=(cdi[p.device.uuid],)) for p in self.planned),
            prepared_at=self.existing.prepared_at if self.existing is not None else now,
        )


def as_prepared(p: PlannedDevice, *, cdi_ids: tuple[str, ...] = ()) -> PreparedDevice:
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
