"""ResourceClaims from the API server: :class:`KubeClaimSource`, the real :class:`ClaimSource`, and
:class:`NoApiClaims` for a node without API access.

A claim is read with the ``resource.k8s.io`` version discovery chose (shared with the slice
publisher) and parsed by ``agent/kube/claims/decode.py``. The kubelet gives a whole prepare batch
45 s, so one GET gives up after 10 s and says so; a claim that does not exist is None, and a
version the server stopped serving (a bare 404 for the path) is discovered again and asked
once more.
"""

from __future__ import annotations

from agent.kube.claims.decode import parse_claim
from agent.kube.claims.model import ClaimRef, ResourceClaim
from agent.kube.client import KubeClient
from agent.kube.discovery import GROUP, ResourceApi
from agent.kube.errors import NO_API_REASON, KubeError, KubeNotFoundError

#: well inside the kubelet's 45 s deadline for a whole NodePrepareResources call
CLAIM_TIMEOUT_S = 10.0
#: a claim is at most 32 results and 32 configs of ≤ 10 KiB parameters, plus metadata
CLAIM_MAX_BYTES = 2 * 1024 * 1024


class KubeClaimSource:
    def __init__(
        self, *, client: KubeClient, resource_api: ResourceApi | None = None, timeout_s: float = CLAIM_TIMEOUT_S
    ) -> None:
        self._client = client
        self._api = resource_api or ResourceApi(client)
        self._timeout_s = timeout_s

    async def get_claim(self, ref: ClaimRef) -> ResourceClaim | None:
        """The claim named by ``ref`` (its UID may differ); None when it does not exist. Raises KubeError."""
        for attempt in (1, 2):
            version = await self._api.version()
            path = self._api.path(version, "resourceclaims", namespace=ref.namespace, name=ref.name)
            try:
                body = await self._client.get(path, timeout_s=self._timeout_s, max_bytes=CLAIM_MAX_BYTES)
            except KubeNotFoundError as exc:
                if exc.object_missing:
                    return None
                self._api.forget(version)
                if attempt == 2:
                    raise
                continue
            return parse_claim(body, api_version=f"{GROUP}/{version}")
        raise AssertionError("unreachable")


class NoApiClaims:
    """Every claim read fails with the reason (preparation turns it into a per-claim error)."""

    async def get_claim(self, ref: ClaimRef) -> ResourceClaim | None:
        raise KubeError(f"cannot read claim {ref}: {NO_API_REASON}")
