"""The kubelet's PodResources API as a grpcio server on a Unix socket, with the kubelet's manners.

Tests set which containers hold which device IDs (:meth:`FakePodResources.allocate` /
:meth:`release`), turn ``GetAllocatableResources`` off (UNIMPLEMENTED, as older or gated
kubelets answer), make calls fail or rate-limit (RESOURCE_EXHAUSTED, as the kubelet does past
100 calls/s), or stop the server (the socket goes away with the kubelet).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tests._grpcio import podresources_v1_pb2 as pb
from tests._grpcio import podresources_v1_pb2_grpc as pb_grpc


@dataclass
class FakePodResources:
    directory: Path
    #: (namespace, pod, container) -> resource name -> device IDs
    held: dict[tuple[str, str, str], dict[str, list[str]]] = field(default_factory=dict)
    #: resource name -> allocatable IDs (what ListAndWatch made healthy)
    allocatable: dict[str, list[str]] = field(default_factory=dict)
    allocatable_served: bool = True
    #: when set, every call fails with this status
    fail: grpc.StatusCode | None = None
    calls: int = 0
    _server: grpc.aio.Server | None = None
    _threaded: grpc.Server | None = None

    @property
    def socket(self) -> Path:
        return self.directory / "kubelet.sock"

    def allocate(self, namespace: str, pod: str, container: str, resource: str, ids: list[str]) -> None:
        self.held.setdefault((namespace, pod, container), {}).setdefault(resource, []).extend(ids)

    def release(self, namespace: str, pod: str) -> None:
        for key in [k for k in self.held if k[:2] == (namespace, pod)]:
            del self.held[key]

    async def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        server = grpc.aio.server()
        pb_grpc.add_PodResourcesListerServicer_to_server(_Lister(self), server)
        server.add_insecure_port(f"unix://{self.socket}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace=None)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    def start_threaded(self) -> None:
        """The same server on grpcio threads, for tests that are not async."""
        self.directory.mkdir(parents=True, exist_ok=True)
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_PodResourcesListerServicer_to_server(_ThreadedLister(self), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._threaded = server

    def stop_threaded(self) -> None:
        server, self._threaded = self._threaded, None
        if server is not None:
            server.stop(grace=None)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    def list_response(self) -> pb.ListPodResourcesResponse:
        pods: dict[tuple[str, str], Any] = {}
        for (namespace, pod, container), resources in self.held.items():
            entry = pods.setdefault((namespace, pod), pb.PodResources(name=pod, namespace=namespace))
            entry.containers.append(
                pb.ContainerResources(
                    name=container,
                    devices=[pb.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in resources.items()],
                )
            )
        return pb.ListPodResourcesResponse(pod_resources=list(pods.values()))


class _ThreadedLister(pb_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    def __init__(self, fake: FakePodResources) -> None:
        self.fake = fake

    def List(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.fake.calls += 1
        return self.fake.list_response()

    def GetAllocatableResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.fake.calls += 1
        devices = [pb.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in self.fake.allocatable.items()]
        return pb.AllocatableResourcesResponse(devices=devices)


class _Lister(pb_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    def __init__(self, fake: FakePodResources) -> None:
        self.fake = fake

    async def _check(self, context: grpc.aio.ServicerContext) -> None:  # type: ignore[type-arg]
        self.fake.calls += 1
        if self.fake.fail is not None:
            message = "rejected by rate limit" if self.fake.fail is grpc.StatusCode.RESOURCE_EXHAUSTED else "fail"
            await context.abort(self.fake.fail, message)

    async def List(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # type: ignore[type-arg]
        await self._check(context)
        return self.fake.list_response()

    async def GetAllocatableResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # type: ignore[type-arg]
        await self._check(context)
        if not self.fake.allocatable_served:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        devices = [pb.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in self.fake.allocatable.items()]
        return pb.AllocatableResourcesResponse(devices=devices)
