"""The per-claim CDI specs on disk, read back: what a lost checkpoint is rebuilt from.

Each prepared claim has a transient spec ``<vendor>-<class>_<claim UID>.json`` whose devices
are named ``<claim UID>-<device UUID part>``; so the files say which claims are prepared and
which GPU or MIG devices each holds, and, in their device-level ``env``, which variables the
claim's config added (the names the driver reserves for itself are told apart by prefix).
Namespace, name and request names are not in the files; an entry rebuilt from them is
marked incomplete until the kubelet prepares the claim again.

Blocking (file I/O); call through ``asyncio.to_thread``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog

from agent.cdi.errors import CdiError
from agent.cdi.names import claim_uid_of, device_part
from agent.cdi.writer import read_spec_file, spec_files
from agent.dra.claims.checkpoint import PreparedClaim, PreparedDevice
from agent.dra.claims.gpuconfig import reserved
from agent.dra.devices import DraDevice

log = structlog.get_logger("agent.dra")


@dataclass(frozen=True, slots=True)
class SpecDevice:
    #: the UUID part of the CDI device name (``device_part(uuid)``)
    part: str
    cdi_id: str
    env: dict[str, str]


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
                    env={k: v for k, v in env.items() if not reserved(k)},
                )
            )
        if devices:
            out[uid] = devices
    return out


def rebuild_claims(
    specs: dict[str, list[SpecDevice]], devices: list[DraDevice], *, pool: str, now: str
) -> dict[str, PreparedClaim]:
    """Incomplete checkpoint entries for the claims whose specs name devices of this node."""
    by_part = {device_part(d.uuid): d for d in devices}
    claims: dict[str, PreparedClaim] = {}
    for uid, found in sorted(specs.items()):
        prepared = []
        for spec_device in found:
            device = by_part.get(spec_device.part)
            if device is None:
                log.warning("dra.rebuild_unknown_device", claim_uid=uid, device=spec_device.part)
                continue
            prepared.append(
                PreparedDevice(
                    pool=pool,
                    name=device.name,
                    uuid=device.uuid,
                    gpu_uuid=device.gpu_uuid,
                    requests=(),
                    share_id=None,
                    cdi_ids=(spec_device.cdi_id,),
                    env=spec_device.env,
                )
            )
        if prepared:
            claims[uid] = PreparedClaim(
                namespace="", name="", uid=uid, devices=tuple(prepared), prepared_at=now, complete=False
            )
    return claims
