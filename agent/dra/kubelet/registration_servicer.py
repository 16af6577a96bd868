"""The ``pluginregistration.Registration`` gRPC service on the registration socket."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpclib.const
import structlog
from grpclib.server import Stream

from agent._proto.pluginregistration import pluginregistration as pb
from agent.dra.kubelet.registration import RegistrationState
from agent.dra.kubelet.servicer import received
from agent.dra.metrics import DraMetrics

log = structlog.get_logger("agent.dra")

SERVICE = "/pluginregistration.Registration"


class RegistrationServicer:
    """``on_registered`` runs after every accepted registration (a kubelet (re)started)."""

    def __init__(
        self, state: RegistrationState, metrics: DraMetrics, *, on_registered: Callable[[], None] = lambda: None
    ) -> None:
        self._state = state
        self._metrics = metrics
        self._on_registered = on_registered

    async def get_info(self, stream: Stream[Any, Any]) -> None:
        await stream.recv_message()
        info = self._state.info()
        log.info("dra.get_info", endpoint=info.endpoint, versions=list(info.supported_versions))
        await stream.send_message(
            pb.PluginInfo(
                type=info.type,
                name=info.name,
                endpoint=info.endpoint,
                supported_versions=list(info.supported_versions),
            )
        )

    async def notify_registration_status(self, stream: Stream[Any, Any]) -> None:
        request = await received(stream)
        registered = bool(request.plugin_registered)
        self._state.notified(registered, request.error)
        self._metrics.notifications.labels(result="registered" if registered else "rejected").inc()
        self._metrics.registered.set(1 if registered else 0)
        if registered:
            self._on_registered()
        await stream.send_message(pb.RegistrationStatusResponse())

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        unary = grpclib.const.Cardinality.UNARY_UNARY
        return {
            f"{SERVICE}/GetInfo": grpclib.const.Handler(self.get_info, unary, pb.InfoRequest, pb.PluginInfo),
            f"{SERVICE}/NotifyRegistrationStatus": grpclib.const.Handler(
                self.notify_registration_status, unary, pb.RegistrationStatus, pb.RegistrationStatusResponse
            ),
        }
