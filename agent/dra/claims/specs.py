"""The per-claim CDI specs on disk, read back: what a lost checkpoint is rebuilt from.

Each prepared claim has a transient spec ``<vendor>-<class>_<claim UID>.json`` whose devices
are named ``<claim UID>-<device UUID part>``; so the files say which claims are prepared and
which GPU or MIG devices each holds, and, in their device-level ``env``, which variables the
claim's config added (the names the driver reserves for itself are told apart by prefix).
Namespace, name and request names are not in the files; an entry rebuilt from them is
marked incomplete until the kubelet prepares the claim again. A MIG instance a spec names that
sits where a partition of its GPU would is taken for that partition (the caller records it as
the agent's); a share's memory is not in the files either, so a rebuilt share counts as the
whole GPU's memory until the kubelet prepares it again (no other share fits meanwhile: safe).

Blocking (file I/O); call through ``asyncio.to_thread``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog

from agent.cdi.claimenv import SHARE_SEPARATOR
from agent.cdi.errors import CdiError
from agent.cdi.names import claim_uid_of, device_part
from agent.cdi.writer import read_spec_file, spec_files
from agent.core.inventory.model import Inventory, MigDevice, MigPlacement
from agent.dra.claims.checkpoint import PreparedClaim, PreparedDevice
from agent.dra.claims.gpuconfig import reserved
from agent.dra.devices import DraDevice

log = structlog.get_logger("agent.dra")


@dataclass(frozen=True, slots=True)
class SpecDevice:
    #: the UUID part of the CDI device name (``device_part(uuid)``, or a share key's)
    part: str
    cdi_id: str
    env: dict[str, str]
    mounts: tuple[tuple[str, str], ...] = ()


def read_claim_specs(cdi_root: Path, claim_kind: str) -> dict[str, list[SpecDevice]]:
    """Claim UID -> its devices, for every readable transient spec of ``claim_kind``."""
    out: dict[str, list[SpecDevice]] = {}
    try:
        files = spec_files(cdi_root)
    except CdiError as exc:
        log.warning("dra.rebuild_cannot_list_cdi", error=str(exc))
        return out
    for path in files:
        uid = claim_uid_of(claim_kind, path.name)
        if uid is None:
            continue
        try:
            spec = read_spec_file(path)
        except CdiError as exc:
            log.warning("dra.rebuild_skipped_spec", file=path.name, error=str(exc))
            continue
        if spec.kind != claim_kind:
            continue
        prefix = f"{uid}-"
        devices = []
        for device in spec.devices:
            if not device.name.startswith(prefix):
                continue
            env = dict(e.split("=", 1) for e in device.container_edits.env if "=" in e)
            devices.append(
                SpecDevice(
                    part=device.name[len(prefix) :],
                    cdi_id=f"{claim_kind}={device.name}",
                    # the claim's config and a share's MPS limits; the driver's own come back with the device
                    env={k: v for k, v in env.items() if not reserved(k) or k.startswith("CUDA_MPS_")},
                    mounts=tuple((m.host_path, m.container_path) for m in device.container_edits.mounts),
                )
            )
        if devices:
            out[uid] = devices
    return out


def rebuild_claims(
    specs: dict[str, list[SpecDevice]], devices: list[DraDevice], inventory: Inventory, *, pool: str, now: str
) -> dict[str, PreparedClaim]:
    """Incomplete checkpoint entries for the claims whose specs name devices of this node."""
    by_part: dict[str, DraDevice] = {}
    for d in devices:
        by_part.setdefault(device_part(d.uuid), d)
    partitions = {(d.gpu_uuid, d.partition.placement): d for d in devices if d.partition is not None}
    migs = {device_part(m.uuid): m for g in inventory.gpus for m in g.mig_devices}
    claims: dict[str, PreparedClaim] = {}
    for uid, found in sorted(specs.items()):
        prepared = []
        for spec_device in found:
            rebuilt = _rebuilt(spec_device, by_part, partitions, migs, pool)
            if rebuilt is None:
                log.warning("dra.rebuild_unknown_device", claim_uid=uid, device=spec_device.part)
                continue
            prepared.append(rebuilt)
        if prepared:
            claims[uid] = PreparedClaim(
                namespace="", name="", uid=uid, devices=tuple(prepared), prepared_at=now, complete=False
            )
    return claims


def _rebuilt(
    spec_device: SpecDevice,
    by_part: dict[str, DraDevice],
    partitions: dict[tuple[str, MigPlacement], DraDevice],
    migs: dict[str, MigDevice],
    pool: str,
) -> PreparedDevice | None:
    part, share, share_id = spec_device.part.partition(SHARE_SEPARATOR)
    mig = migs.get(part)
    device: DraDevice | None
    if mig is not None and mig.placement is not None and (mig.parent_uuid, mig.placement) in partitions:
        device = partitions[(mig.parent_uuid, mig.placement)]
    else:
        device = by_part.get(part)
    if device is None or (share and device.share is None):
        return None
    partition = device.partition if mig is not None else None
    return PreparedDevice(
        pool=pool,
        name=device.name,
        uuid=mig.uuid if partition is not None and mig is not None else device.uuid,
        gpu_uuid=device.gpu_uuid,
        requests=(),
        share_id=share_id or None,
        cdi_ids=(spec_device.cdi_id,),
        env=spec_device.env,
        placement=partition.placement if partition is not None else None,
        profile_id=partition.profile_id if partition is not None else None,
        share_memory=device.share.memory if share and device.share is not None else None,
        mps=bool(share) and device.share is not None and device.share.mps,
        mounts=spec_device.mounts,
    )
