"""The ``v1alpha1.DRAResourceHealth`` gRPC service: the health feed, translated to protobuf."""

from __future__ import annotations

from typing import Any

import grpclib.const
import structlog
from grpclib import GRPCError
from grpclib.const import Status
from grpclib.server import Stream

from agent._proto.drahealth_v1alpha1 import v1alpha1 as pb
from agent.base.logs import next_request_id
from agent.core.health.model import HealthState
from agent.dra.kubelet.healthfeed import DeviceHealthReport, HealthFeed, TooManyStreams
from agent.dra.metrics import DraMetrics

log = structlog.get_logger("agent.dra")

SERVICE = "/v1alpha1.DRAResourceHealth"
_STATUS = {
    HealthState.HEALTHY: pb.HealthStatus.HEALTHY,
    HealthState.UNHEALTHY: pb.HealthStatus.UNHEALTHY,
    HealthState.UNKNOWN: pb.HealthStatus.UNKNOWN,
}


def response(reports: list[DeviceHealthReport]) -> pb.NodeWatchResourcesResponse:
    return pb.NodeWatchResourcesResponse(
        devices=[
            pb.DeviceHealth(
                device=pb.DeviceIdentifier(pool_name=r.pool, device_name=r.device),
                health=_STATUS[r.state],
                last_updated_time=r.updated,
                health_check_timeout_seconds=r.timeout_s,
                message=r.message,
            )
            for r in reports
        ]
    )


class HealthServicer:
    def __init__(self, feed: HealthFeed, metrics: DraMetrics) -> None:
        self._feed = feed
        self._metrics = metrics

    async def node_watch_resources(self, stream: Stream[Any, Any]) -> None:
        """Complete lists until the kubelet goes away (grpclib cancels this) or the server stops."""
        await stream.recv_message()
        with structlog.contextvars.bound_contextvars(request_id=next_request_id(), method="NodeWatchResources"):
            try:
                with self._feed.stream() as reports:
                    self._metrics.health_streams.set(self._feed.streams)
                    log.info("dra.health_stream_opened", streams=self._feed.streams)
                    try:
                        async for batch in reports:
                            await stream.send_message(response(batch))
                    finally:
                        log.info("dra.health_stream_closed")
            except TooManyStreams as exc:
                raise GRPCError(Status.RESOURCE_EXHAUSTED, str(exc)) from exc
            finally:
                self._metrics.health_streams.set(self._feed.streams)

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            f"{SERVICE}/NodeWatchResources": grpclib.const.Handler(
                self.node_watch_resources,
                grpclib.const.Cardinality.UNARY_STREAM,
                pb.NodeWatchResourcesRequest,
                pb.NodeWatchResourcesResponse,
            )
        }
