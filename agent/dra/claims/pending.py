"""A claim between its plan and its record: devices reserved, CDI spec still to be written.

:class:`PendingClaim` is what one preparation carries from step 1 (read, decide, reserve) through
the MIG instances made for it and its shares' MPS settings to step 2 (the batch's CDI specs) of
:class:`~agent.dra.claims.driver.DraDriver`; once its spec is written, :meth:`PendingClaim.prepared`
is the checkpoint entry it becomes. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.cdi.claimenv import ClaimDevices
from agent.dra.claims.checkpoint import PreparedClaim, PreparedDevice
from agent.dra.claims.plan import PlannedDevice
from agent.kube.claims.model import ClaimRef


@dataclass(frozen=True, slots=True)
class ShareSetup:
    """What a share under MPS adds to its CDI device: the client limits and the daemon's directories."""

    env: Mapping[str, str]
    #: (host path, container path)
    mounts: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class PendingClaim:
    """A claim whose devices are reserved and whose CDI spec is still to be written."""

    ref: ClaimRef
    planned: list[PlannedDevice]
    existing: PreparedClaim | None
    #: the claim's status.allocation.allocationTimestamp, when the cluster sets it
    allocated_at: str | None = None
    #: index into ``planned`` -> the UUID of the MIG instance made for it
    made: Mapping[int, str] = field(default_factory=dict)
    #: index into ``planned`` -> a share's MPS settings
    shares: Mapping[int, ShareSetup] = field(default_factory=dict)

    def key(self, i: int) -> str:
        """The CDI device of ``planned[i]``: the MIG instance made for it, a share, or the device."""
        return self.made.get(i) or self.planned[i].cdi_key

    def keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.key(i) for i in range(len(self.planned))))

    def env(self, i: int) -> dict[str, str]:
        share = self.shares.get(i)
        return {**self.planned[i].env, **(share.env if share is not None else {})}

    def cdi_devices(self) -> ClaimDevices:
        env: dict[str, tuple[str, ...]] = {}
        mounts: dict[str, tuple[tuple[str, str], ...]] = {}
        for i in range(len(self.planned)):
            env.setdefault(self.key(i), tuple(f"{k}={v}" for k, v in self.env(i).items()))
            share = self.shares.get(i)
            if share is not None and share.mounts:
                mounts.setdefault(self.key(i), share.mounts)
        return ClaimDevices(devices=self.keys(), env=env, mounts=mounts)

    def prepared(self, cdi_names: list[str], now: str) -> PreparedClaim:
        cdi = dict(zip(self.keys(), cdi_names, strict=True))
        devices = []
        for i, p in enumerate(self.planned):
            made, share = self.made.get(i), self.shares.get(i)
            devices.append(
                as_prepared(
                    p,
                    cdi_ids=(cdi[self.key(i)],),
                    uuid=made,
                    env=self.env(i),
                    mounts=share.mounts if share is not None else (),
                )
            )
        return PreparedClaim(
            namespace=self.ref.namespace,
            name=self.ref.name,
            uid=self.ref.uid,
            devices=tuple(devices),
            prepared_at=self.existing.prepared_at if self.existing is not None else now,
        )


def as_prepared(
    p: PlannedDevice,
    *,
    cdi_ids: tuple[str, ...] = (),
    uuid: str | None = None,
    env: Mapping[str, str] | None = None,
    mounts: tuple[tuple[str, str], ...] = (),
) -> PreparedDevice:
    """The checkpoint's record of a planned device (CDI IDs once its spec is written; the UUID of
    the MIG instance made for it; a share's MPS variables and mounts)."""
    partition = p.device.partition
    share = p.device.share
    return PreparedDevice(
        pool=p.result.pool,
        name=p.device.name,
        uuid=uuid or p.device.uuid,
        gpu_uuid=p.device.gpu_uuid,
        requests=(p.result.main_request,),
        share_id=p.result.share_id,
        cdi_ids=cdi_ids,
        env=dict(p.env if env is None else env),
        admin_access=p.result.admin_access,
        placement=partition.placement if partition is not None else None,
        profile_id=partition.profile_id if partition is not None else None,
        share_memory=p.share_memory,
        mps=share.mps if share is not None and p.share_memory is not None else False,
        mounts=mounts,
    )
