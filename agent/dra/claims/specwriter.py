"""The prepared claims' CDI specs: written and removed a batch at a time, read back when needed.

:class:`ClaimSpecWriter` is the driver's hand in the CDI service: a call's new claims get their
specs in one write (one worker-thread hop, one directory fsync), each claim answered alone
(its qualified device names, or the error that stopped it); removals likewise. When the
checkpoint is lost, :meth:`ClaimSpecWriter.read_back` rebuilds what it can from the specs on
disk. :func:`specs_to_keep` tells the CDI reconciler which claim specs are legitimate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path

from agent.cdi.claimenv import ClaimDevices, share_key
from agent.cdi.errors import CdiError
from agent.cdi.names import check_claim_uid, claim_device_name, qualified_name
from agent.cdi.service import CdiProvider
from agent.core.inventory.model import Inventory
from agent.dra.claims.checkpoint import PreparedClaim
from agent.dra.claims.prepared import PreparedClaims
from agent.dra.claims.specs import read_claim_specs, rebuild_claims
from agent.dra.devices import DraDevice


class ClaimSpecWriter:
    def __init__(self, cdi: CdiProvider, *, cdi_root: Path | None = None, claim_kind: str = "") -> None:
        """``cdi_root`` and ``claim_kind`` (None and "" with CDI off) say where to read specs back."""
        self._cdi = cdi
        self._cdi_root = cdi_root
        self._claim_kind = claim_kind

    async def write(self, claims: Mapping[str, ClaimDevices]) -> dict[str, list[str] | CdiError]:
        """Every claim's spec in one go: claim UID -> its qualified device names, or its error."""
        try:
            written = await self._cdi.prepare_claims(claims)
        except CdiError as exc:
            written = dict.fromkeys(claims, exc)
        return {uid: written.get(uid, CdiError("the CDI service gave no answer for this claim")) for uid in claims}

    def names(self, claims: Mapping[str, ClaimDevices]) -> dict[str, list[str]] | None:
        """The qualified device names :meth:`write` will answer for each claim, before writing;
        None when they cannot be known up front (CDI off, or a name CDI would refuse).

        A claim's names are a pure function of the claim kind, its UID and its device keys
        (``agent/cdi/names.py``), which is what lets the checkpoint be written while the specs are.
        """
        if self._cdi_root is None or not self._claim_kind:
            return None
        try:
            return {
                uid: [qualified_name(self._claim_kind, claim_device_name(uid, key)) for key in claim.devices]
                for uid, claim in claims.items()
            }
        except CdiError:
            return None

    async def remove(self, uids: Sequence[str]) -> Mapping[str, CdiError | None]:
        """Remove the claims' specs in one go: claim UID -> the error, None (or absent) when gone."""
        # a UID CDI refuses never had a spec, and no claim was ever prepared under it
        valid = [uid for uid in uids if _cdi_uid_ok(uid)]
        return await self._cdi.unprepare_claims(valid) if valid else {}

    async def discard(self, uids: Sequence[str]) -> None:
        """Remove specs of claims that did not get prepared after all; a failure is left to the reconciler."""
        with contextlib.suppress(CdiError):  # a spec left behind is an orphan the CDI reconciler removes
            await self._cdi.unprepare_claims(uids)

    def read_back(
        self, devices: list[DraDevice], inventory: Inventory, *, pool: str, now: str
    ) -> dict[str, PreparedClaim]:
        """Incomplete entries for the claims whose specs are on disk (blocking: file I/O)."""
        if self._cdi_root is None or not self._claim_kind:
            return {}
        specs = read_claim_specs(self._cdi_root, self._claim_kind)
        return rebuild_claims(specs, devices, inventory, pool=pool, now=now)


def specs_to_keep(prepared: PreparedClaims) -> dict[str, ClaimDevices] | None:
    """Which claim specs the CDI reconciler must keep (and re-create when missing); None
    while the checkpoint is not loaded (every claim spec on disk is kept then)."""
    if not prepared.loaded:
        return None
    out = {}
    for uid, claim in prepared.items():
        env: dict[str, tuple[str, ...]] = {}
        mounts: dict[str, tuple[tuple[str, str], ...]] = {}
        keys = []
        for device in claim.devices:
            key = share_key(device.uuid, device.share_id) if device.is_share and device.share_id else device.uuid
            keys.append(key)
            env.setdefault(key, tuple(f"{k}={v}" for k, v in device.env.items()))
            if device.mounts:
                mounts.setdefault(key, device.mounts)
        out[uid] = ClaimDevices(devices=tuple(dict.fromkeys(keys)), env=env, mounts=mounts)
    return out


def _cdi_uid_ok(uid: str) -> bool:
    try:
        check_claim_uid(uid)
    except CdiError:
        return False
    return True
