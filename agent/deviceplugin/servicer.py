"""The ``v1beta1.DevicePlugin`` gRPC service: a translator between protobuf and the domain.

Each unary RPC runs through ``DevicePluginServicer._unary`` from receiving its request to answering, which binds
``request_id``, ``method`` and ``resource`` to structlog's contextvars, records the call in
the RPC metrics (result: ``ok``, the status in kebab case, or ``aborted``) and maps domain
errors onto gRPC statuses:

* :class:`AllocationError` ``INVALID_ARGUMENT`` -> ``Status.INVALID_ARGUMENT``
* :class:`AllocationError` ``FAILED_PRECONDITION`` -> ``Status.FAILED_PRECONDITION``

Refusals are logged (warning) with the device IDs cut short; the server keeps serving. A request
that cannot be received (too large, malformed, truncated: see :mod:`agent.grpc.limits`) is counted
with its status. Anything else escaping a handler is a bug: logged with its traceback and
answered ``INTERNAL``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpclib.const
import structlog
from grpclib import GRPCError
from grpclib.const import Status
from grpclib.exceptions import StreamTerminatedError
from grpclib.server import Stream

from agent._proto.deviceplugin import v1beta1 as pb
from agent.base.logs import debug_enabled, next_request_id
from agent.deviceplugin.allocate import AllocationKey, ContainerAllocation, check_request_size
from agent.deviceplugin.errors import AllocationError, ErrorKind, short_ids
from agent.deviceplugin.resources import DeviceState
from agent.deviceplugin.service import PreferredRequest, ResourceService
from agent.grpc.grpclib_adapter import connection_of
from agent.grpc.limits import cut, status_label

log = structlog.get_logger("agent.plugin")
#: the per-Allocate line is debug: at info its cost showed in the throughput (docs/performance.md)
_debug = debug_enabled("agent.plugin")

SERVICE = "/v1beta1.DevicePlugin"
_STATUS = {
    ErrorKind.INVALID_ARGUMENT: Status.INVALID_ARGUMENT,
    ErrorKind.FAILED_PRECONDITION: Status.FAILED_PRECONDITION,
}

T = TypeVar("T")
RpcObserver = Callable[[str, str, float], None]  # (method, result, seconds)


def devices_message(devices: list[DeviceState]) -> pb.ListAndWatchResponse:
    out = []
    for state in devices:
        device = pb.Device(id=state.device.id, health=state.health)
        if state.device.numa_node is not None:
            device.topology = pb.TopologyInfo(nodes=[pb.NumaNode(id=state.device.numa_node)])
        out.append(device)
    return pb.ListAndWatchResponse(devices=out)


def allocate_response(allocations: list[ContainerAllocation]) -> pb.AllocateResponse:
    """The protobuf answer to an Allocate. Answers repeat (the same devices under the same
    config), and building betterproto messages costs more than the rest of an Allocate, so
    they are kept (bounded) and shared: nothing mutates a message once built. An answer with
    annotations carries a per-request key (``cdi-annotations``) and is never kept."""
    if any(a.annotations for a in allocations):
        return pb.AllocateResponse(container_responses=[_build_response(a) for a in allocations])
    return _kept_answer(tuple(a.key() for a in allocations))


@functools.lru_cache(maxsize=256)
def _kept_answer(keys: tuple[AllocationKey, ...]) -> pb.AllocateResponse:
    return pb.AllocateResponse(container_responses=[_kept_response(k) for k in keys])


@functools.lru_cache(maxsize=256)
def _kept_response(key: AllocationKey) -> pb.ContainerAllocateResponse:
    return _build_response(ContainerAllocation.from_key(key))


def _build_response(allocation: ContainerAllocation) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(
        envs=dict(allocation.envs),
        mounts=[
            pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in allocation.mounts
        ],
        annotations=dict(allocation.annotations),
        cdi_devices=[pb.CdiDevice(name=n) for n in allocation.cdi_devices],
    )


class DevicePluginServicer:
    """Serves one :class:`ResourceService` (one resource, one server run)."""

    def __init__(self, service: ResourceService, *, observe: RpcObserver | None = None) -> None:
        self.service = service
        self._observe = observe
        #: handler tasks of the open ListAndWatch streams
        self.streams: set[asyncio.Task[Any]] = set()

    async def _unary(self, stream: Stream[Any, Any], method: str, handle: Callable[[Any], Awaitable[Any]]) -> None:
        """Receive, answer through ``handle``, send; the module docstring says what is logged and
        counted. One plain coroutine, no context managers: this is every Allocate's path."""
        started = time.perf_counter()
        result = "ok"
        # grpclib runs each call in a task of its own, whose context is a copy: what is bound
        # here is the call's alone and goes with its task (no reset needed, none paid for)
        structlog.contextvars.bind_contextvars(
            request_id=next_request_id(), method=method, resource=self.service.resource.name
        )
        try:
            request = await stream.recv_message()
            response = await handle(request)
        except AllocationError as exc:
            result = exc.kind.value
            log.warning(
                "request refused",
                error=cut(str(exc)),
                device_ids=short_ids(exc.device_ids),
                device_count=len(exc.device_ids),
                status=exc.kind.value,
            )
            raise GRPCError(_STATUS[exc.kind], cut(str(exc))) from exc
        except GRPCError as exc:  # refused while receiving; the gate logged it
            result = status_label(exc.status)
            raise
        except (asyncio.CancelledError, StreamTerminatedError):  # the client went away
            result = "aborted"
            raise
        except Exception as exc:
            result = "internal"
            log.exception("request failed")
            raise GRPCError(Status.INTERNAL, f"{method}: internal error: {cut(str(exc), 200)}") from exc
        finally:
            if self._observe is not None:
                self._observe(method, result, time.perf_counter() - started)
        await stream.send_message(response)

    # --- handlers ----------------------------------------------------------------------

    async def get_device_plugin_options(self, stream: Stream[pb.Empty, pb.DevicePluginOptions]) -> None:
        self.service.options_requested(connection_of(stream))

        async def handle(_: pb.Empty) -> pb.DevicePluginOptions:
            options = self.service.options
            return pb.DevicePluginOptions(
                pre_start_required=options.pre_start_required,
                get_preferred_allocation_available=options.get_preferred_allocation_available,
            )

        await self._unary(stream, "GetDevicePluginOptions", handle)

    async def list_and_watch(self, stream: Stream[pb.Empty, pb.ListAndWatchResponse]) -> None:
        """Full list on open, then again after every change, until this run stops.

        Returning ends the stream with OK; a client that goes away cancels this task (grpclib),
        and the subscription is released on the way out either way.
        """
        await stream.recv_message()
        service = self.service
        task = asyncio.current_task()
        assert task is not None
        self.streams.add(task)
        token = service.stream_opened(connection_of(stream))
        try:
            with (
                structlog.contextvars.bound_contextvars(
                    request_id=next_request_id(), method="ListAndWatch", resource=service.resource.name
                ),
                service.changed.subscribe() as changes,
            ):
                log.info("ListAndWatch stream opened")
                await service.grants_decided()
                last: tuple[tuple[str, bool], ...] | None = None
                while not service.stopping:
                    devices = service.devices()
                    key = tuple((d.device.id, d.healthy) for d in devices)
                    if key != last:  # a change elsewhere (another resource's GPU) sends nothing
                        await stream.send_message(devices_message(devices))
                        last = key
                    await changes.get()
                log.info("ListAndWatch stream ended: server stopping")
        finally:
            self.streams.discard(task)
            service.stream_closed(token)

    async def get_preferred_allocation(
        self, stream: Stream[pb.PreferredAllocationRequest, pb.PreferredAllocationResponse]
    ) -> None:
        async def handle(request: pb.PreferredAllocationRequest) -> pb.PreferredAllocationResponse:
            check_request_size(
                self.service.resource,
                [[r.available_device_i_ds, r.must_include_device_i_ds] for r in request.container_requests],
                "preferred allocation",
            )
            requests = [
                PreferredRequest(
                    available=list(r.available_device_i_ds),
                    must_include=list(r.must_include_device_i_ds),
                    size=r.allocation_size,
                )
                for r in request.container_requests
            ]
            answers = self.service.preferred(requests)
            return pb.PreferredAllocationResponse(
                container_responses=[pb.ContainerPreferredAllocationResponse(device_i_ds=ids) for ids in answers]
            )

        await self._unary(stream, "GetPreferredAllocation", handle)

    async def allocate(self, stream: Stream[pb.AllocateRequest, pb.AllocateResponse]) -> None:
        async def handle(request: pb.AllocateRequest) -> pb.AllocateResponse:
            ids = [list(r.devices_ids) for r in request.container_requests]
            allocations = await self.service.allocate(ids)
            if _debug():
                log.debug("allocated", device_ids=ids, answers=[a.summary() for a in allocations])
            return allocate_response(allocations)

        await self._unary(stream, "Allocate", handle)

    async def pre_start_container(
        self, stream: Stream[pb.PreStartContainerRequest, pb.PreStartContainerResponse]
    ) -> None:
        async def handle(request: pb.PreStartContainerRequest) -> pb.PreStartContainerResponse:
            self.service.prestart(list(request.devices_ids))
            return pb.PreStartContainerResponse()

        await self._unary(stream, "PreStartContainer", handle)

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        unary = grpclib.const.Cardinality.UNARY_UNARY
        return {
            f"{SERVICE}/GetDevicePluginOptions": grpclib.const.Handler(
                self.get_device_plugin_options, unary, pb.Empty, pb.DevicePluginOptions
            ),
            f"{SERVICE}/ListAndWatch": grpclib.const.Handler(
                self.list_and_watch, grpclib.const.Cardinality.UNARY_STREAM, pb.Empty, pb.ListAndWatchResponse
            ),
            f"{SERVICE}/GetPreferredAllocation": grpclib.const.Handler(
                self.get_preferred_allocation, unary, pb.PreferredAllocationRequest, pb.PreferredAllocationResponse
            ),
            f"{SERVICE}/Allocate": grpclib.const.Handler(self.allocate, unary, pb.AllocateRequest, pb.AllocateResponse),
            f"{SERVICE}/PreStartContainer": grpclib.const.Handler(
                self.pre_start_container, unary, pb.PreStartContainerRequest, pb.PreStartContainerResponse
            ),
        }
