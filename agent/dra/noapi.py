"""DRA on a node without Kubernetes API access (no ``--kubeconfig``, not in a pod).

The kubelet plugin still runs there — its checkpoint says which GPUs prepared claims hold, so
no handover can give such a GPU away, and the kubelet can still unprepare those claims — but
nothing can be published and no claim can be read: the null publisher says so on ``/readyz``
and every new claim gets a per-claim error naming the reason.
"""

from __future__ import annotations

import asyncio

from agent.dra.claim import ClaimRef, ResourceClaim
from agent.kube.errors import KubeError
from agent.mechanism import Readiness

REASON = "no Kubernetes API access (no --kubeconfig, and not running in a pod)"


class NoApiPublisher:
    """Publishes nothing; ready, with the reason, because there is nothing it could do."""

    async def run(self) -> None:
        await asyncio.Event().wait()

    def published_gpus(self) -> frozenset[str]:
        return frozenset()

    def kick(self) -> None:
        return None

    def resync(self) -> None:
        return None

    def slice_check(self) -> tuple[frozenset[str], frozenset[str]] | None:
        return None  # nothing published, nothing to compare

    def readiness(self) -> Readiness:
        return Readiness(True, f"not published: {REASON}")

    def debug_state(self) -> dict[str, object]:
        return {"enabled": False, "reason": REASON}


class NoApiClaims:
    """Every claim read fails with the reason (preparation turns it into a per-claim error)."""

    async def get_claim(self, ref: ClaimRef) -> ResourceClaim | None:
        raise KubeError(f"cannot read claim {ref}: {REASON}")
