"""One resource's device-plugin server: serve on its socket, prove it answers, Register.

Lifecycle (:meth:`PluginServer.run`, until cancelled), one *run* at a time:

1. build a fresh :class:`ResourceService` (new change feed, new streams) and serve it on
   ``<device-plugins>/<socket>`` (stale file removed first);
2. dial the socket and call GetDevicePluginOptions (NVIDIA does the same) so the kubelet
   never gets an endpoint that does not answer;
3. call ``Registration/Register`` on ``kubelet.sock``; failures are retried with backoff and
   shown in :meth:`PluginServer.debug_state`. The kubelet calls GetDevicePluginOptions on us
   from inside its Register handler, which works because the server runs on this loop;
4. wait for :meth:`restart` (kubelet restarted, our socket deleted) or cancellation, then
   stop: end this run's ListAndWatch streams, close the server, remove the socket file.

Restart is stop -> serve -> Register, in that order: the kubelet marks a resource's *current*
endpoint unhealthy when an old ListAndWatch stream ends, so old streams end before the new
registration exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
from grpclib.client import Channel

from agent._proto.deviceplugin import v1beta1 as pb
from agent.backoff import Backoff
from agent.inventory.model import Inventory
from agent.plugin.metrics import PluginMetrics
from agent.plugin.preferred import TopologyScorer
from agent.plugin.resources import DeviceState, Resource
from agent.plugin.service import ResourceService
from agent.plugin.servicer import DevicePluginServicer
from agent.sockets import UnixGrpcServer

log = structlog.get_logger("agent.plugin")

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"


@dataclass(frozen=True, slots=True)
class Timeouts:
    self_check_s: float = 5.0
    register_s: float = 10.0  # the kubelet itself dials us with a 10 s limit inside Register
    # how long a stopping run waits for its streams to end before cancelling them (a client
    # that stopped reading); kept short so a kubelet restart re-registers well within 1 s
    stream_drain_s: float = 0.25


DEFAULT_BACKOFF = Backoff(initial_s=0.2)
DEFAULT_TIMEOUTS = Timeouts()


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


class PluginServer:
    def __init__(
        self,
        *,
        resource: Resource,
        make_service: Callable[[Resource], ResourceService],
        plugin_dir: Path,
        metrics: PluginMetrics,
        backoff: Backoff = DEFAULT_BACKOFF,
        timeouts: Timeouts = DEFAULT_TIMEOUTS,
    ) -> None:
        self.resource = resource
        self.socket_path = plugin_dir / resource.socket_name
        self.kubelet_socket = plugin_dir / KUBELET_SOCKET
        self._make_service = make_service
        self._metrics = metrics
        self._backoff = backoff
        self._timeouts = timeouts
        self._restart = asyncio.Event()
        self._restart_reason = ""
        self._server: UnixGrpcServer | None = None
        self._servicer: DevicePluginServicer | None = None
        self.service: ResourceService | None = None
        self.registered = False
        self.last_error = ""
        self.attempts = 0  # Register calls in the current run
        self.registrations = 0  # successful Register calls since start
        #: inode of the kubelet.sock the current registration went to (None: not registered)
        self.kubelet_inode: int | None = None
        self.runs = 0

    # --- what the manager calls ---------------------------------------------------------

    @property
    def serving(self) -> bool:
        return self._server is not None and self._server.serving

    @property
    def open_streams(self) -> int:
        return len(self._servicer.streams) if self._servicer else 0

    def socket_lost(self) -> bool:
        """True when this server listens but its socket file is gone or replaced."""
        return self._server is not None and self._server.serving and not self._server.socket_present()

    def restart(self, reason: str) -> None:
        """Ask for stop -> serve -> Register; repeated requests before it happens coalesce."""
        if not self._restart.is_set():
            self._restart_reason = reason
            self._restart.set()

    def update(self, resource: Resource, *, inventory: Inventory, scorer: TopologyScorer) -> None:
        """Adopt a re-planned resource of the same name in place (the inventory changed).

        Called by the manager on the loop thread. No restart and no new Register: the current
        run's service switches to ``resource`` and ``inventory`` and its open ListAndWatch
        streams send the new list; a later run gets them from ``make_service``.
        """
        if resource.name != self.resource.name:
            raise ValueError(f"server for {self.resource.name} cannot serve {resource.name}")
        self.resource = resource
        if self.service is not None:
            self.service.update(resource=resource, inventory=inventory, scorer=scorer)
            self._update_device_gauge()

    def notify(self) -> None:
        """The device list may have changed: open ListAndWatch streams send it again."""
        if self.service is not None:
            self.service.notify()
            self._update_device_gauge()

    def advertised(self) -> list[DeviceState]:
        """The devices this server offers the kubelet now (none while it is not serving)."""
        return self.service.devices() if self.service is not None and self.serving else []

    def debug_state(self) -> dict[str, object]:
        devices = self.service.devices() if self.service else []
        return {
            "socket": str(self.socket_path),
            "serving": self.serving,
            "registered": self.registered,
            "last_register_error": self.last_error,
            "register_attempts": self.attempts,
            "registrations": self.registrations,
            "runs": self.runs,
            "device_count": len(devices),
            "healthy_count": sum(1 for d in devices if d.healthy),
            "open_streams": self.open_streams,
        }

    # --- the loop -----------------------------------------------------------------------

    async def run(self) -> None:
        bound = structlog.contextvars.bound_contextvars(resource=self.resource.name)
        with bound:
            try:
                while True:
                    self._restart.clear()
                    if await self._start() and await self._register():
                        await self._restart.wait()
                    log.info("restarting device plugin server", reason=self._restart_reason)
                    await self._stop()
            finally:
                await self._stop()
                # gone for good (resource vanished, config rebuild, shutdown): advertises nothing
                for health in ("Healthy", "Unhealthy"):
                    self._metrics.devices.labels(self.resource.name, health).set(0)

    async def _start(self) -> bool:
        """Serve and self-check, retrying with backoff; False if a restart interrupted it."""
        failures = 0
        while True:
            self.runs += 1
            self.service = self._make_service(self.resource)
            self._servicer = DevicePluginServicer(self.service, observe=self._observe_rpc)
            self._server = UnixGrpcServer(self.socket_path, [self._servicer])
            try:
                await self._server.start()
                await self._self_check()
            except Exception as exc:  # StartupError, a self-check that fails or times out
                failures += 1
                self.last_error = f"serve on {self.socket_path}: {exc}"
                log.warning("device plugin server failed to start", error=self.last_error, attempt=failures)
                await self._stop()
                if await self._wait_restart(self._backoff.delay(failures)):
                    return False
                continue
            log.info("serving device plugin", socket=str(self.socket_path), devices=len(self.service.devices()))
            self._update_device_gauge()
            return True

    async def _self_check(self) -> None:
        channel = Channel(path=str(self.socket_path))
        try:
            await pb.DevicePluginStub(channel).get_device_plugin_options(
                pb.Empty(), timeout=self._timeouts.self_check_s
            )
        finally:
            channel.close()

    async def _register(self) -> bool:
        """Register until the kubelet accepts; False if a restart interrupted it."""
        self.attempts = 0
        options = self.service.options if self.service else None
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=self.socket_path.name,
            resource_name=self.resource.name,
            options=pb.DevicePluginOptions(
                pre_start_required=bool(options and options.pre_start_required),
                get_preferred_allocation_available=bool(options and options.get_preferred_allocation_available),
            ),
        )
        while True:
            self.attempts += 1
            inode = _inode(self.kubelet_socket)
            channel = Channel(path=str(self.kubelet_socket))
            try:
                await pb.RegistrationStub(channel).register(request, timeout=self._timeouts.register_s)
            except Exception as exc:  # grpc status, no socket, refused, timeout: all retried
                self.last_error = f"Register with {self.kubelet_socket}: {type(exc).__name__}: {exc}"
                self._metrics.registrations.labels(self.resource.name, "error").inc()
                delay = self._backoff.delay(self.attempts)
                log.warning(
                    "registration with the kubelet failed",
                    error=self.last_error,
                    attempt=self.attempts,
                    retry_in_s=round(delay, 3),
                )
            else:
                self.registered = True
                self.kubelet_inode = inode
                self.registrations += 1
                self.last_error = ""
                self._metrics.registrations.labels(self.resource.name, "ok").inc()
                self._metrics.registered.labels(self.resource.name).set(1)
                log.info("registered with the kubelet", endpoint=request.endpoint, attempts=self.attempts)
                return True
            finally:
                channel.close()
            if await self._wait_restart(delay):
                return False

    async def _wait_restart(self, delay: float) -> bool:
        """Sleep ``delay`` seconds unless a restart is requested first (then True)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._restart.wait()
        return self._restart.is_set()

    async def _stop(self) -> None:
        """End this run's streams, then close the server. Idempotent."""
        self.registered = False
        self.kubelet_inode = None
        self._metrics.registered.labels(self.resource.name).set(0)
        server, servicer, service = self._server, self._servicer, self.service
        self._server = None
        if service is not None:
            service.stop_streams()
        try:
            if servicer is not None and servicer.streams:
                # streams return after their current send; one whose client stopped reading is
                # cancelled by the server close below
                await asyncio.wait(set(servicer.streams), timeout=self._timeouts.stream_drain_s)
        finally:
            # even when cancelled while draining: this run's listener must not outlive it
            if server is not None:
                await server.close()

    def _observe_rpc(self, method: str, result: str, seconds: float) -> None:
        self._metrics.rpc_seconds.labels(self.resource.name, method, result).observe(seconds)

    def _update_device_gauge(self) -> None:
        if self.service is None:
            return
        devices = self.service.devices()
        healthy = sum(1 for d in devices if d.healthy)
        self._metrics.devices.labels(self.resource.name, "Healthy").set(healthy)
        self._metrics.devices.labels(self.resource.name, "Unhealthy").set(len(devices) - healthy)
