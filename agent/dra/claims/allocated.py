"""Claims the scheduler allocated on this node's devices that the kubelet has not had prepared yet.

A GPU draining away from DRA leaves the ResourceSlice at once, but the scheduler may have
allocated a claim from the slice that still listed it (its cycle started before the slice
changed); the pod is bound a moment later and the kubelet asks for the claim to be prepared
later still, sometimes seconds. If the drain completed meanwhile, that Prepare is refused (the
GPU is the device plugin's now) and the kubelet retries it forever: the scheduler never
allocates an allocated claim again, so the pod never starts.

So while a GPU drains away from DRA, :class:`AllocatedClaims` looks for such claims: the claims of
the pods bound to this node (``agent/kube/podclaims.py``), read from the API server, whose
allocation names a device of this driver in this node's pool and that are not prepared. The DRA
mechanism counts them as holders (:meth:`agent.dra.mechanism.DraMechanism.usage`), with the time
the pod list was asked for as the observation's age: the handover trusts only a list asked for a
settle after the slice without the GPU was written (``DRA_SETTLE_S`` in
``agent/core/ownership/handover.py``), by when every pod the scheduler placed from the old slice is
bound. Prepare is honoured on a GPU draining away from DRA, so such a claim is prepared when the
kubelet asks, and the drain waits for it until it is unprepared.

A pod list or a claim read that fails makes the view unknown: the drain waits, it never guesses.
Without API access nothing can have been allocated from our slices (there are none): the view is
empty and current.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from agent.core.config.schema import Owner
from agent.core.mechanism import Holder
from agent.core.ownership.table import OwnershipState
from agent.dra.claims.holders import add_claim
from agent.kube.claims.model import ClaimRef, ClaimSource, ResourceClaim
from agent.kube.errors import KubeError
from agent.kube.podclaims import PodClaims

log = structlog.get_logger("agent.dra")

#: how often the pods are listed while a GPU drains away from DRA
POLL_S = 0.5


class PodClaimLister(Protocol):
    async def list(self) -> list[PodClaims]:
        """The claims of this node's unfinished pods. Raises KubeError."""
        ...


@dataclass(frozen=True, slots=True)
class AllocatedView:
    """One look: physical GPU -> claims allocated on it and not prepared, as of a monotonic time."""

    known: bool
    holders: dict[str, tuple[Holder, ...]] = field(default_factory=dict)
    as_of: float = float("-inf")
    reason: str = ""


class AllocatedClaims:
    def __init__(
        self,
        *,
        pods: PodClaimLister | None,
        claims: ClaimSource,
        driver: str,
        pool: str,
        gpu_of: Callable[[str], str | None],
        prepared: Collection[str],
        ownership: OwnershipState,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = POLL_S,
    ) -> None:
        self._pods = pods
        self._claims = claims
        self._driver = driver
        self._pool = pool
        self._gpu_of = gpu_of
        #: UIDs of the prepared claims (the checkpoint): those hold their GPUs already
        self._prepared = prepared
        self._ownership = ownership
        self._clock = clock
        self._poll_s = poll_s
        self._view = AllocatedView(known=False, reason="the node's pods were not listed yet")
        #: (namespace, claim, pod UID) -> the claim as read (a bound pod's allocation does not change)
        self._read: dict[tuple[str, str, str], ResourceClaim | None] = {}
        self.looks = 0

    def view(self) -> AllocatedView:
        if self._pods is None:  # no API: no slices, nothing allocated from them
            return AllocatedView(known=True, as_of=self._clock())
        return self._view

    def needed(self) -> bool:
        """Whether a GPU drains away from DRA (only then is the view kept current)."""
        return any(d.source is Owner.DRA and not d.closing for d in self._ownership.current.draining.values())

    async def run(self) -> None:
        """Look every ``poll_s`` while a GPU drains away from DRA; otherwise wait for one."""
        if self._pods is None:
            await asyncio.Event().wait()
        with self._ownership.changes.subscribe() as changes:
            while True:
                while not self.needed():
                    await changes.get()
                await self.refresh()
                await asyncio.sleep(self._poll_s)

    async def refresh(self) -> None:
        """One look: list the node's pods, read their claims (each once per pod). Never raises."""
        if self._pods is None:
            return
        self.looks += 1
        started = self._clock()
        try:
            pods = await self._pods.list()
            holders = await self._holders(pods)
        except KubeError as exc:
            if self._view.known or self._view.reason != str(exc):
                log.warning(
                    "cannot tell which claims were allocated on this node; drains from DRA wait", error=str(exc)
                )
            self._view = AllocatedView(known=False, reason=f"reading the node's pods and claims: {exc}")
            return
        self._view = AllocatedView(known=True, holders=holders, as_of=started)

    async def _holders(self, pods: list[PodClaims]) -> dict[str, tuple[Holder, ...]]:
        keys = {(p.namespace, c, p.uid): p for p in pods for c in p.claims}
        for key in [k for k in self._read if k not in keys]:
            del self._read[key]
        out: dict[str, list[Holder]] = {}
        for key, pod in keys.items():
            if key not in self._read:
                self._read[key] = await self._claims.get_claim(ClaimRef(namespace=key[0], name=key[1], uid=""))
            claim = self._read[key]
            if claim is None or not claim.allocated or claim.uid in self._prepared:
                continue
            ours = [r for r in claim.results if r.driver == self._driver and r.pool == self._pool]
            devices = [(gpu, r.device) for r in ours if (gpu := self._gpu_of(r.device)) is not None]
            add_claim(
                out,
                namespace=claim.namespace,
                name=claim.name,
                uid=claim.uid,
                devices=devices,
                detail=f"allocated for pod {pod.pod}, not prepared yet",
            )
        return {gpu: tuple(h) for gpu, h in out.items()}
