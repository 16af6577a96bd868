"""The ``DRAPlugin`` gRPC services (v1 and v1beta1): translators between protobuf and the driver.

Both versions call the same :class:`~agent.dra.claims.driver.DraDriver` methods and differ only in
their protobuf module and in ``Device.share_id`` (v1 only). Per-claim failures travel inside
the answer; a gRPC error would fail the kubelet's whole batch, so only a bug in this code
(logged with its traceback) becomes one (``INTERNAL``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import ModuleType
from typing import Any

import grpclib.const
import structlog
from grpclib import GRPCError
from grpclib.const import Status
from grpclib.server import Stream

from agent._proto.dra_v1.k8s.io.kubelet.pkg.apis.dra import v1 as pb_v1
from agent._proto.dra_v1beta1.k8s.io.kubelet.pkg.apis.dra import v1beta1 as pb_v1beta1
from agent.base.logs import next_request_id
from agent.dra.claims.driver import ClaimAnswer, DraDriver
from agent.dra.metrics import DraMetrics
from agent.kube.claims.model import ClaimRef

log = structlog.get_logger("agent.dra")


async def received(stream: Stream[Any, Any]) -> Any:
    """The request of a unary call; a call that ends without one is INVALID_ARGUMENT."""
    request = await stream.recv_message()
    if request is None:
        raise GRPCError(Status.INVALID_ARGUMENT, "no request message")
    return request


class DraPluginServicer:
    """One version of ``DRAPlugin``; build it with :func:`v1_servicer` or :func:`v1beta1_servicer`."""

    def __init__(self, driver: DraDriver, metrics: DraMetrics, *, pb: ModuleType, api: str, share_ids: bool) -> None:
        self._driver = driver
        self._metrics = metrics
        self._pb = pb
        self.api = api
        self._share_ids = share_ids
        self.service = f"/k8s.io.kubelet.pkg.apis.dra.{api}.DRAPlugin"

    @asynccontextmanager
    async def _rpc(self, method: str) -> AsyncIterator[None]:
        started = time.perf_counter()
        with structlog.contextvars.bound_contextvars(request_id=next_request_id(), method=method, api=self.api):
            try:
                yield
            except (GRPCError, asyncio.CancelledError):
                raise
            except Exception as exc:
                log.exception("dra.request_failed")
                raise GRPCError(Status.INTERNAL, f"{method}: internal error: {exc!r}"[:512]) from exc
            finally:
                seconds = time.perf_counter() - started
                self._metrics.call_seconds.labels(method=method, api=self.api).observe(seconds)

    @staticmethod
    def _refs(claims: list[Any]) -> list[ClaimRef]:
        return [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]

    def _prepared(self, answer: ClaimAnswer) -> Any:
        pb = self._pb
        if answer.error:
            return pb.NodePrepareResourceResponse(error=answer.error)
        devices = []
        for d in answer.devices:
            device = pb.Device(
                request_names=list(d.request_names),
                pool_name=d.pool,
                device_name=d.device,
                cdi_device_ids=list(d.cdi_ids),
            )
            if self._share_ids and d.share_id is not None:
                device.share_id = d.share_id
            devices.append(device)
        return pb.NodePrepareResourceResponse(devices=devices)

    async def node_prepare_resources(self, stream: Stream[Any, Any]) -> None:
        request = await received(stream)
        async with self._rpc("NodePrepareResources"):
            refs = self._refs(request.claims)
            answers = await self._driver.prepare(refs)
            log.info(
                "dra.prepare_answered",
                claims=len(answers),
                failed=sorted(uid for uid, a in answers.items() if a.error),
            )
            response = self._pb.NodePrepareResourcesResponse(
                claims={uid: self._prepared(answer) for uid, answer in answers.items()}
            )
        await stream.send_message(response)

    async def node_unprepare_resources(self, stream: Stream[Any, Any]) -> None:
        request = await received(stream)
        async with self._rpc("NodeUnprepareResources"):
            errors = await self._driver.unprepare(self._refs(request.claims))
            log.info("dra.unprepare_answered", claims=len(errors), failed=sorted(u for u, e in errors.items() if e))
            response = self._pb.NodeUnprepareResourcesResponse(
                claims={uid: self._pb.NodeUnprepareResourceResponse(error=error) for uid, error in errors.items()}
            )
        await stream.send_message(response)

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        pb = self._pb
        unary = grpclib.const.Cardinality.UNARY_UNARY
        return {
            f"{self.service}/NodePrepareResources": grpclib.const.Handler(
                self.node_prepare_resources, unary, pb.NodePrepareResourcesRequest, pb.NodePrepareResourcesResponse
            ),
            f"{self.service}/NodeUnprepareResources": grpclib.const.Handler(
                self.node_unprepare_resources,
                unary,
                pb.NodeUnprepareResourcesRequest,
                pb.NodeUnprepareResourcesResponse,
            ),
        }


def v1_servicer(driver: DraDriver, metrics: DraMetrics) -> DraPluginServicer:
    return DraPluginServicer(driver, metrics, pb=pb_v1, api="v1", share_ids=True)


def v1beta1_servicer(driver: DraDriver, metrics: DraMetrics) -> DraPluginServicer:
    return DraPluginServicer(driver, metrics, pb=pb_v1beta1, api="v1beta1", share_ids=False)
