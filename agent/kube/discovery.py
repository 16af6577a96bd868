"""Which ``resource.k8s.io`` version the API server serves: v1, else v1beta2, else v1beta1.

1.34+ serves v1 by default; 1.33 serves v1beta1 (and v1beta2 when enabled); 1.32 only
v1beta1 (and v1alpha3, which we do not speak). The answer is found through API discovery
(``GET /apis/resource.k8s.io``), kept, and found again when a request for the chosen version
comes back 404 for the path itself (an upgrade or downgrade of the API server): callers report
that with :meth:`ResourceApi.forget`.

The publisher and the claim source share one :class:`ResourceApi`, so one discovery serves both.
"""

from __future__ import annotations

import asyncio
from urllib.parse import quote

import structlog

from agent.kube.client import KubeClient
from agent.kube.errors import KubeError, KubeNotFoundError

log = structlog.get_logger("agent.kube")

GROUP = "resource.k8s.io"
#: most preferred first
VERSIONS = ("v1", "v1beta2", "v1beta1")
#: a discovery document lists a handful of versions
DISCOVERY_BYTES = 256 * 1024


class ResourceApi:
    """The ``resource.k8s.io`` version in use against one API server."""

    def __init__(self, client: KubeClient, *, versions: tuple[str, ...] = VERSIONS) -> None:
        self._client = client
        self._versions = versions
        self._version: str | None = None
        self._lock = asyncio.Lock()
        #: versions the server listed at the last discovery
        self.served: tuple[str, ...] = ()
        #: completed discoveries, for tests and /debug
        self.discoveries = 0

    @property
    def current(self) -> str | None:
        """The version in use, or None before (or after a forget, until) the next discovery."""
        return self._version

    async def version(self) -> str:
        """The version to use, discovering it when unknown. Raises KubeError."""
        if self._version is not None:
            return self._version
        async with self._lock:
            if self._version is None:
                self._version = await self._discover()
            return self._version

    def forget(self, version: str) -> None:
        """``version`` answered 404 for a path it should serve: discover again before the next request."""
        if self._version == version:
            log.warning("resource.k8s.io version no longer served; discovering again", version=version)
            self._version = None

    def path(self, version: str, resource: str, *, name: str = "", namespace: str = "") -> str:
        base = f"/apis/{GROUP}/{version}"
        if namespace:
            base += f"/namespaces/{quote(namespace, safe='')}"
        base += f"/{resource}"
        return f"{base}/{quote(name, safe='')}" if name else base

    async def _discover(self) -> str:
        try:
            group = await self._client.get(f"/apis/{GROUP}", max_bytes=DISCOVERY_BYTES)
        except KubeNotFoundError as exc:
            raise KubeError(
                f"the API server {self._client.server} does not serve {GROUP}: DRA needs Kubernetes 1.32 or later "
                "with DRA enabled (on by default from 1.34)",
                status=404,
                recoverable=True,
            ) from exc
        listed = group.get("versions")
        served = (
            tuple(str(v.get("version")) for v in listed if isinstance(v, dict) and isinstance(v.get("version"), str))
            if isinstance(listed, list)
            else ()
        )
        self.served = served
        self.discoveries += 1
        for version in self._versions:
            if version in served:
                log.info("resource.k8s.io version chosen", version=version, served=list(served))
                return version
        raise KubeError(
            f"the API server {self._client.server} serves {GROUP} versions {list(served)[:8]} "
            f"but none of {', '.join(self._versions)}",
            status=404,
            recoverable=True,
        )
