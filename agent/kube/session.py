"""Opening the process's one API client, or none when the node has no API access configured."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import structlog
from prometheus_client import CollectorRegistry

from agent.core.config.schema import Config
from agent.kube.access import SERVICE_ACCOUNT_DIR, kube_config_available
from agent.kube.client import KubeClient, Limits
from agent.kube.metrics import KubeMetrics

log = structlog.get_logger("agent.kube")


@contextlib.asynccontextmanager
async def open_kube(
    config: Config,
    *,
    registry: CollectorRegistry | None = None,
    limits: Limits | None = None,
    env: Mapping[str, str] | None = None,
    sa_dir: Path = SERVICE_ACCOUNT_DIR,
) -> AsyncIterator[KubeClient | None]:
    """The shared client (closed on exit), or None when neither a kubeconfig nor in-cluster access is set.

    Raises KubeConfigError (a ConfigError) when an explicit kubeconfig cannot be used. With
    None, the node runs without the API: labels come from the config only, and DRA (which
    needs ResourceSlices and claims) says so on /readyz.
    """
    if not kube_config_available(config.kubeconfig, env=env, sa_dir=sa_dir):
        log.info("no Kubernetes API access configured (no --kubeconfig, not in a pod)")
        yield None
        return
    client = KubeClient.from_config(
        config.kubeconfig, env=env, sa_dir=sa_dir, limits=limits, metrics=KubeMetrics(registry)
    )
    log.info("Kubernetes API access", server=client.server, source=client.access.source)
    async with client:
        yield client
