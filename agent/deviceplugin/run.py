"""One run of a resource's device-plugin server: listen, prove it answers, stop in order.

A :class:`ServerRun` is one serve -> Register cycle of :class:`~agent.deviceplugin.server.PluginServer`:
a fresh :class:`ResourceService` (new change feed, new streams, new kubelet link) served on the
resource's socket. The server decides when to start, register and stop runs; this module only
does the socket work, in the order the kubelet needs:

* :meth:`ServerRun.start` listens (stale file removed first) and dials the socket for
  GetDevicePluginOptions (NVIDIA does the same), so the kubelet never gets an endpoint that
  does not answer;
* :meth:`ServerRun.relisten` listens at the path again for the same run when the file went,
  keeping the old listener's connections (and streams) open;
* :meth:`ServerRun.stop` ends the run's ListAndWatch streams, then closes every listener and
  removes the socket file: the kubelet marks a resource's *current* endpoint unhealthy when an
  old stream ends, so old streams end before any new registration exists.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from grpclib.client import Channel

from agent._proto.deviceplugin import v1beta1 as pb
from agent.deviceplugin.link import KubeletLink
from agent.deviceplugin.service import ResourceService
from agent.deviceplugin.servicer import DevicePluginServicer, RpcObserver
from agent.grpc.sockets import UnixGrpcServer


class ServerRun:
    def __init__(self, socket_path: Path, service: ResourceService, *, observe: RpcObserver | None = None) -> None:
        self.socket_path = socket_path
        self.service = service
        self.servicer = DevicePluginServicer(service, observe=observe)
        self.listener = UnixGrpcServer(socket_path, [self.servicer])
        #: earlier listeners of this run whose socket file went (their connections stay open)
        self.retired: list[UnixGrpcServer] = []

    @property
    def link(self) -> KubeletLink:
        return self.service.link

    @property
    def serving(self) -> bool:
        return self.listener.serving

    def socket_present(self) -> bool:
        """The file at our path is the one this run listens on."""
        return self.listener.socket_present()

    async def start(self, *, self_check_s: float) -> None:
        """Listen and self-check; raises StartupError, a gRPC error or TimeoutError."""
        await self.listener.start()
        channel = Channel(path=str(self.socket_path))
        try:
            await pb.DevicePluginStub(channel).get_device_plugin_options(pb.Empty(), timeout=self_check_s)
        finally:
            channel.close()

    async def relisten(self) -> None:
        """Listen at the path again for this run; raises StartupError when it cannot."""
        listener = UnixGrpcServer(self.socket_path, [self.servicer])
        await listener.start()
        self.retired.append(self.listener)
        self.listener = listener

    async def stop(self, *, drain_s: float) -> None:
        """End this run's streams, then close its listeners. Safe to call twice."""
        self.service.stop_streams()
        try:
            if self.servicer.streams:
                # streams return after their current send; one whose client stopped reading is
                # cancelled by the listener close below
                await asyncio.wait(set(self.servicer.streams), timeout=drain_s)
        finally:
            # even when cancelled while draining: this run's listeners must not outlive it. The
            # current one first: it removes the file; a retired one finds it gone
            await _close_all([self.listener, *self.retired])


async def _close_all(listeners: list[UnixGrpcServer]) -> None:
    """Close every listener, even when cancelled part-way (then re-raise)."""
    cancelled: asyncio.CancelledError | None = None
    for listener in listeners:
        try:
            await listener.close()
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is not None:
        raise cancelled
