"""The DRA kubelet plugin's two Unix sockets, served for the agent's whole lifetime.

* ``<kubelet root>/plugins/<driver>/dra.sock``: ``v1.DRAPlugin``, ``v1beta1.DRAPlugin`` and
  ``v1alpha1.DRAResourceHealth`` (the endpoint named in GetInfo);
* ``<kubelet root>/plugins_registry/<driver>-reg.sock``: ``pluginregistration.Registration``.

Start order (``kubelet-plugin-registration.md`` §4): the DRA socket serves and answers a
NodePrepareResources call of our own before the registration socket exists, because the
kubelet may call the endpoint the moment it sees the registration socket. Shutdown goes the
other way: removing the registration socket is what deregisters.

Both directories are watched (:mod:`agent.base.fswatch`). A socket file someone deletes or
replaces is served again at once: a new server on the path first, then the old one closed
(its open connections end; calls in flight on them were shielded by the driver and the
kubelet's retry gets the stored answer). A re-created registration socket makes the kubelet
register again. A kubelet restart needs nothing from us: it walks ``plugins_registry/`` and
calls GetInfo again on the sockets that are there.

Names are per driver, so another DRA driver (NVIDIA's ``gpu.nvidia.com``) serves beside this
one; a socket file at our path that another process serves on is never taken over
(:mod:`agent.grpc.sockets`): the start is retried with backoff and shown on readiness.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from grpclib.client import Channel

from agent._proto.dra_v1.k8s.io.kubelet.pkg.apis.dra import v1 as pb_v1
from agent.base.backoff import Backoff
from agent.base.fswatch import RESCAN, DirectoryWatcher
from agent.grpc.sockets import UnixGrpcServer

log = structlog.get_logger("agent.dra")

DRA_SOCKET = "dra.sock"
REGISTRY_DIR = "plugins_registry"
#: between attempts to serve a plugin socket that failed to start
SERVE_BACKOFF = Backoff(initial_s=0.2, max_s=10.0)
SELF_CHECK_S = 5.0


def registration_socket_name(driver_name: str) -> str:
    return f"{driver_name}-reg.sock"


@dataclass
class SocketEndpoint:
    """One socket path and the handlers served on it; the current server, if any."""

    name: str
    path: Path
    handlers: Sequence[Any]
    check: Callable[[Path], Awaitable[None]] | None = None
    server: UnixGrpcServer | None = None
    last_error: str = ""
    starts: int = 0
    failures: int = 0

    @property
    def serving(self) -> bool:
        return self.server is not None and self.server.serving

    def lost(self) -> bool:
        """Serving, but the file at ``path`` is gone or is not ours any more."""
        return self.server is not None and self.server.serving and not self.server.socket_present()

    def as_dict(self) -> dict[str, object]:
        return {
            "path": str(self.path),
            "serving": self.serving,
            "starts": self.starts,
            "failures": self.failures,
            "last_error": self.last_error,
        }


async def _answers_prepare(path: Path) -> None:
    """Our own empty NodePrepareResources on ``path``: the endpoint is up for the kubelet."""
    channel = Channel(path=str(path))
    try:
        await pb_v1.DraPluginStub(channel).node_prepare_resources(
            pb_v1.NodePrepareResourcesRequest(), timeout=SELF_CHECK_S
        )
    finally:
        channel.close()


class KubeletPlugin:
    def __init__(
        self,
        *,
        dra_socket: Path,
        registration_socket: Path,
        dra_handlers: Sequence[Any],
        registration_handlers: Sequence[Any],
        backoff: Backoff = SERVE_BACKOFF,
        self_check: Callable[[Path], Awaitable[None]] = _answers_prepare,
    ) -> None:
        # a path too long for a Unix socket fails at serve time (UnixGrpcServer), on /readyz:
        # DRA must not keep the device plugin of a node that gives it no GPU from starting
        self.dra = SocketEndpoint("dra", dra_socket, list(dra_handlers), check=self_check)
        self.registration = SocketEndpoint("registration", registration_socket, list(registration_handlers))
        self._backoff = backoff
        self.running = False
        self.restarts = 0

    @property
    def serving(self) -> bool:
        return self.dra.serving and self.registration.serving

    def debug_state(self) -> dict[str, object]:
        return {
            "running": self.running,
            "sockets": {"dra": self.dra.as_dict(), "registration": self.registration.as_dict()},
            "socket_restarts": self.restarts,
        }

    async def run(self) -> None:
        """Serve both sockets until cancelled; both files are removed on the way out."""
        try:
            async with (
                DirectoryWatcher(self.dra.path.parent) as dra_dir,
                DirectoryWatcher(self.registration.path.parent) as registry_dir,
            ):
                await self._serve(self.dra)
                await self._serve(self.registration)
                self.running = True
                log.info("dra.plugin_serving", endpoint=str(self.dra.path), registration=str(self.registration.path))
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._keep(self.dra, dra_dir), name="dra-watch-dra-socket")
                    tg.create_task(self._keep(self.registration, registry_dir), name="dra-watch-registration-socket")
        finally:
            self.running = False
            # the registration socket goes first: its removal is what deregisters
            for endpoint in (self.registration, self.dra):
                server, endpoint.server = endpoint.server, None
                if server is not None:
                    await server.close()

    async def _keep(self, endpoint: SocketEndpoint, watcher: DirectoryWatcher) -> None:
        async for names in watcher:
            if (RESCAN in names or endpoint.path.name in names) and endpoint.lost():
                log.warning("dra.socket_lost", socket=endpoint.name, path=str(endpoint.path))
                self.restarts += 1
                await self._serve(endpoint)

    async def _serve(self, endpoint: SocketEndpoint) -> None:
        """Serve a new server on the endpoint (retrying with backoff), then close the old one."""
        attempt = 0
        while True:
            attempt += 1
            server = UnixGrpcServer(endpoint.path, endpoint.handlers)
            try:
                await server.start()
                if endpoint.check is not None:
                    await endpoint.check(endpoint.path)
            except asyncio.CancelledError:
                await server.close()
                raise
            except Exception as exc:  # StartupError, a self-check that fails or times out
                await server.close()
                endpoint.failures += 1
                endpoint.last_error = f"{endpoint.path}: {exc}"
                delay = self._backoff.delay(attempt)
                log.warning(
                    "dra.socket_start_failed",
                    socket=endpoint.name,
                    error=endpoint.last_error,
                    retry_in_s=round(delay, 3),
                )
                await asyncio.sleep(delay)
                continue
            break
        old, endpoint.server = endpoint.server, server
        endpoint.starts += 1
        endpoint.last_error = ""
        if old is not None:
            with contextlib.suppress(Exception):
                await old.close()
