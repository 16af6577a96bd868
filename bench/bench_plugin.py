"""Device plugin latencies on real Unix sockets; prints figures (no assertions).

* Allocate p50/p99 from a grpcio client in a separate process (sync stubs, a thread per
  concurrent caller) at 1 and 32 concurrent callers;
* health change (simulated Xid) -> the updated list read from an open ListAndWatch stream;
* kubelet restart (the old kubelet dies, device-plugins/ wiped, new kubelet.sock) -> the one
  fresh Register reaching the new kubelet, and -> the kubelet's ListAndWatch stream open again;
  with the agent paused during the restart (it sees everything at once) and running meanwhile.
  Production timeouts (a 50 ms settle after the last wake-up).

The plugin runs on the simulated ``h100-8x-nvlink`` node in a temporary kubelet root, with the
fake kubelet from the tests. Usage: ``.venv/bin/python bench/bench_plugin.py [--calls N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from tests._grpcio import deviceplugin_v1beta1_pb2 as pb
from tests._grpcio import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from tests.test_plugin_fakes import plugin_harness, wait_for

GPU = "nvidia.com/gpu"


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return f"p50 {at(0.50):7.2f} ms  p99 {at(0.99):7.2f} ms  max {ordered[-1] * 1000:7.2f} ms  (n={len(ordered)})"


def allocate_client(socket: str, device_sets: list[list[str]], concurrency: int, calls: int) -> list[float]:
    """Runs in a child process: ``calls`` Allocate RPCs over ``concurrency`` threads."""
    channel = grpc.insecure_channel(f"unix://{socket}")
    stub = pb_grpc.DevicePluginStub(channel)

    def request(i: int) -> pb.AllocateRequest:
        ids = device_sets[i % len(device_sets)]
        return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])

    for i in range(20):  # warm-up: connection, code paths
        stub.Allocate(request(i))

    def worker(offset: int) -> list[float]:
        out = []
        for i in range(offset, calls, concurrency):
            started = time.perf_counter()
            stub.Allocate(request(i))
            out.append(time.perf_counter() - started)
        return out

    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(worker, range(concurrency)))
    channel.close()
    return [x for r in results for x in r]


async def bench_allocate(calls: int) -> None:
    async with plugin_harness() as h:
        await h.wait_ready()
        gpus = [h.gpu(i) for i in range(8)]
        device_sets = [[g] for g in gpus] + [gpus[:2], gpus[4:8], gpus]
        loop = asyncio.get_running_loop()
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            for concurrency in (1, 32):
                samples = await loop.run_in_executor(
                    pool, allocate_client, str(h.socket()), device_sets, concurrency, calls
                )
                print(f"Allocate, {concurrency:2d} concurrent caller(s):     {percentiles(samples)}")


async def bench_health(rounds: int) -> None:
    async with plugin_harness() as h:
        await h.wait_ready()
        gpu = h.gpu(3)
        samples: list[float] = []
        async with h.channel() as channel:
            call = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty())
            await call.read()
            for i in range(rounds):
                healthy = i % 2 == 1
                started = time.perf_counter()
                h.backend.inject(gpu, healthy=healthy, xid=None if healthy else 79)
                while True:
                    message = await asyncio.wait_for(call.read(), 2.0)
                    assert isinstance(message, pb.ListAndWatchResponse)
                    state = {d.ID: d.health for d in message.devices}[gpu]
                    if state == ("Healthy" if healthy else "Unhealthy"):
                        break
                samples.append(time.perf_counter() - started)
            call.cancel()
        print(f"health change -> ListAndWatch update:    {percentiles(samples)}")


async def bench_restart(rounds: int) -> None:
    for mode in ("paused", "concurrent"):
        async with plugin_harness() as h:
            await h.settled()
            register: list[float] = []
            stream: list[float] = []
            for _ in range(rounds):
                process = h.kubelet.restart_now() if mode == "paused" else await h.kubelet.restart()
                started = time.monotonic()  # the new kubelet listens
                await wait_for(lambda p=process: p.holds_live_stream(GPU), what="the kubelet's stream")  # type: ignore[misc]
                (call,) = [c for c in process.calls if c.accepted]
                opened = process.clients[GPU].opened_at
                assert opened is not None
                register.append(call.at - started)
                stream.append(opened - started)
                await h.settled()
            print(f"kubelet restart ({mode:10s}) -> Register:     {percentiles(register)}")
            print(f"kubelet restart ({mode:10s}) -> stream open:  {percentiles(stream)}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="Allocate calls per concurrency level")
    parser.add_argument("--rounds", type=int, default=200, help="health flips")
    parser.add_argument("--restarts", type=int, default=200, help="kubelet restarts per mode")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    print(f"python {sys.version.split()[0]}, simulated h100-8x-nvlink, real Unix sockets")
    await bench_allocate(args.calls)
    await bench_health(args.rounds)
    await bench_restart(args.restarts)


if __name__ == "__main__":
    asyncio.run(main())
