"""The kubelet's side of ``bench/bench_compare.py``: grpcio clients run in a process of their own.

Every function here runs in the bench's client process (spawned, so grpcio's threads never share
the bench's event loop) and returns plain data. Sync grpcio stubs with one thread per caller, as
the Go kubelet has one goroutine per pod admission.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests._grpcio import deviceplugin_v1beta1_pb2 as pb
from tests._grpcio import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from tests._grpcio import dra_v1_pb2 as dra
from tests._grpcio import dra_v1_pb2_grpc as dra_grpc

WARM_UP_CALLS = 50


def _request(device: str) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[device])])


def allocate_once(socket: str, device: str) -> bytes:
    """One Allocate; the serialized answer (the floor sends the same bytes)."""
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        response = pb_grpc.DevicePluginStub(channel).Allocate(_request(device), timeout=10)
    return bytes(response.SerializeToString())


def allocate_load(socket: str, devices: list[str], callers: int, calls: int) -> tuple[list[float], float]:
    """``calls`` Allocate RPCs over ``callers`` threads on one channel: (latencies, wall seconds).

    Each request asks for one device, round robin over ``devices``, so every answer has the size
    of the floor's canned one.
    """
    requests = [_request(d) for d in devices]
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        for i in range(WARM_UP_CALLS):
            stub.Allocate(requests[i % len(requests)], timeout=10)

        def caller(offset: int) -> list[float]:
            out = []
            for i in range(offset, calls, callers):
                started = time.perf_counter()
                stub.Allocate(requests[i % len(requests)], timeout=30)
                out.append(time.perf_counter() - started)
            return out

        with ThreadPoolExecutor(callers) as pool:
            started = time.perf_counter()
            results = list(pool.map(caller, range(callers)))
            wall = time.perf_counter() - started
    return [x for r in results for x in r], wall


def list_and_watch_waves(socket: str, streams: int, wave: int) -> int:
    """Open ``streams`` ListAndWatch streams, ``wave`` at a time: each reads its first list and is
    cancelled before the next wave opens. Returns how many got their list (a server that caps
    concurrent streams refuses the rest of a wave; those are not counted)."""
    answered = 0
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        for start in range(0, streams, wave):
            calls = [stub.ListAndWatch(pb.Empty(), timeout=30) for _ in range(min(wave, streams - start))]
            for call in calls:
                try:
                    next(call)
                    answered += 1
                except grpc.RpcError:
                    pass
            for call in calls:
                call.cancel()
    return answered


def dra_claims(round_: int, count: int, offset: int, namespace: str) -> list[dra.Claim]:
    return [
        dra.Claim(namespace=namespace, name=f"r{round_}-c{i}", uid=f"uid-r{round_}-c{i}")
        for i in range(offset, offset + count)
    ]


def dra_prepare_rounds(socket: str, rounds: int, batch: int, namespace: str) -> dict[str, list[float]]:
    """Per round, on fresh claims: prepare 1 + unprepare it; prepare ``batch`` + unprepare them."""
    keys = ("prepare 1", "unprepare 1", f"prepare {batch}", f"unprepare {batch}")
    out: dict[str, list[float]] = {k: [] for k in keys}
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = dra_grpc.DRAPluginStub(channel)

        def timed(key: str, call: object, request: object) -> None:
            started = time.perf_counter()
            response = call(request, timeout=45)  # type: ignore[operator]
            out[key].append(time.perf_counter() - started)
            errors = [c.error for c in response.claims.values() if c.error]  # type: ignore[attr-defined]
            if errors:
                raise RuntimeError(f"{key}: {errors[:3]}")

        stub.NodePrepareResources(dra.NodePrepareResourcesRequest(), timeout=10)  # connection warm-up
        for r in range(rounds):
            one = dra_claims(r, 1, batch, namespace)
            timed("prepare 1", stub.NodePrepareResources, dra.NodePrepareResourcesRequest(claims=one))
            timed("unprepare 1", stub.NodeUnprepareResources, dra.NodeUnprepareResourcesRequest(claims=one))
            many = dra_claims(r, batch, 0, namespace)
            timed(f"prepare {batch}", stub.NodePrepareResources, dra.NodePrepareResourcesRequest(claims=many))
            timed(f"unprepare {batch}", stub.NodeUnprepareResources, dra.NodeUnprepareResourcesRequest(claims=many))
    return out


def dra_prepare_sizes(socket: str, rounds: int, sizes: list[int], namespace: str) -> dict[str, list[float]]:
    """Per round and size, on fresh claims: prepare ``size`` claims in one call, then unprepare them.

    Round ``r`` and size ``n`` use claims ``r<r>s<n>-c<i>``; the caller puts them on the API server.
    """
    out: dict[str, list[float]] = {}
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = dra_grpc.DRAPluginStub(channel)
        stub.NodePrepareResources(dra.NodePrepareResourcesRequest(), timeout=10)  # connection warm-up
        for r in range(rounds):
            for size in sizes:
                claims = [
                    dra.Claim(namespace=namespace, name=f"r{r}s{size}-c{i}", uid=f"uid-r{r}s{size}-c{i}")
                    for i in range(size)
                ]
                for key, call, request in (
                    (f"prepare {size}", stub.NodePrepareResources, dra.NodePrepareResourcesRequest(claims=claims)),
                    (
                        f"unprepare {size}",
                        stub.NodeUnprepareResources,
                        dra.NodeUnprepareResourcesRequest(claims=claims),
                    ),
                ):
                    started = time.perf_counter()
                    response = call(request, timeout=45)
                    out.setdefault(key, []).append(time.perf_counter() - started)
                    errors = [c.error for c in response.claims.values() if c.error]
                    if errors:
                        raise RuntimeError(f"{key}: {errors[:3]}")
    return out
