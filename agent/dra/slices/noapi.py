"""Slices on a node without Kubernetes API access (no ``--kubeconfig``, not in a pod).

The kubelet plugin still runs there — its checkpoint says which GPUs prepared claims hold, so
no handover can give such a GPU away, and the kubelet can still unprepare those claims — but
nothing can be published: the null publisher says so on ``/readyz``. Claims cannot be read
either (:class:`agent.kube.claims.source.NoApiClaims`): every new claim gets a per-claim error
naming the reason.
"""

from __future__ import annotations

import asyncio

from agent.core.mechanism import Readiness
from agent.kube.errors import NO_API_REASON as REASON


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
