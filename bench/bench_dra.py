"""DRA claim preparation latencies on the real Unix socket; prints figures (no assertions).

The DRA mechanism runs as the agent builds it (registration, real CDI service writing env-only
specs for simulated GPUs, the checkpoint written with fsync on the temporary directory's file
system), on a simulated node with 64 GPUs so that 64 claims each get a device of their own.
The API server is a fake ClaimSource answering from memory: the figures are the agent's own
cost, not an API server's. The kubelet side is a grpcio client in a separate process.

Measured, each round on fresh claims:

* NodePrepareResources of one claim, then NodeUnprepareResources of it;
* NodePrepareResources of a batch of 64 claims (target <= 250 ms), then of the same 64 again
  (answered from the checkpoint), then NodeUnprepareResources of the 64.

Usage: ``.venv/bin/python bench/bench_dra.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from tests._grpcio import dra_v1_pb2 as pb
from tests._grpcio import dra_v1_pb2_grpc as pb_grpc
from tests.dra_fakes import dra_harness, result

BATCH = 64
NAMESPACE = "bench"


def preset(path: Path, gpus: int) -> Path:
    lines = [
        "name: bench-64",
        "description: 64 simulated GPUs for the DRA benchmark",
        'driver_version: "570.124.06"',
        'cuda_driver_version: "12.8"',
        "defaults: {product_name: NVIDIA H100 80GB HBM3, architecture: hopper, compute_capability: '9.0',"
        " memory_mib: 81559}",
        "gpus:",
        *(f'  - {{pci_bus_id: "0000{i // 32:04X}:{i % 32 + 1:02X}:00.0", numa_node: {i // 32}}}' for i in range(gpus)),
        "topology: {nvlinks: 18, pcie: system}",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def claims(round_: int, count: int, offset: int = 0) -> list[pb.Claim]:
    return [
        pb.Claim(namespace=NAMESPACE, name=f"r{round_}-c{i}", uid=f"uid-r{round_}-c{i}")
        for i in range(offset, offset + count)
    ]


def client(socket: str, rounds: int) -> dict[str, list[float]]:
    """Runs in a child process: the kubelet's calls, timed."""
    channel = grpc.insecure_channel(f"unix://{socket}")
    stub = pb_grpc.DRAPluginStub(channel)
    keys = ("prepare 1", "unprepare 1", "prepare 64", "again 64", "unprepare 64")
    out: dict[str, list[float]] = {k: [] for k in keys}

    def timed(key: str, call: object, request: object) -> object:
        started = time.perf_counter()
        response = call(request, timeout=45)  # type: ignore[operator]
        out[key].append(time.perf_counter() - started)
        errors = [c.error for c in response.claims.values() if c.error]  # type: ignore[attr-defined]
        assert not errors, errors[:3]
        return response

    stub.NodePrepareResources(pb.NodePrepareResourcesRequest())  # warm-up: connection
    for r in range(rounds):
        one = claims(r, 1, offset=BATCH)
        timed("prepare 1", stub.NodePrepareResources, pb.NodePrepareResourcesRequest(claims=one))
        timed("unprepare 1", stub.NodeUnprepareResources, pb.NodeUnprepareResourcesRequest(claims=one))
        batch = claims(r, BATCH)
        timed("prepare 64", stub.NodePrepareResources, pb.NodePrepareResourcesRequest(claims=batch))
        timed("again 64", stub.NodePrepareResources, pb.NodePrepareResourcesRequest(claims=batch))
        timed("unprepare 64", stub.NodeUnprepareResources, pb.NodeUnprepareResourcesRequest(claims=batch))
    channel.close()
    return out


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return f"p50 {at(0.50):7.2f} ms  p99 {at(0.99):7.2f} ms  max {ordered[-1] * 1000:7.2f} ms  (n={len(ordered)})"


def fs_type(path: Path) -> str:
    """The file system type ``path`` is on (the longest matching mount point in /proc/mounts)."""
    best, kind = "", "unknown"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) > 2 and str(path).startswith(fields[1]) and len(fields[1]) > len(best):
                best, kind = fields[1], fields[2]
    return kind


async def main(rounds: int, fs: str) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-dra-"))
    async with dra_harness(preset=str(preset(work / "bench-64.yaml", BATCH + 1))) as h:
        await h.kubelet().register()
        for r in range(rounds):
            for i in range(BATCH + 1):
                h.claims.add(f"r{r}-c{i}", result(f"gpu-{i}"), namespace=NAMESPACE, uid=f"uid-r{r}-c{i}")
        loop = asyncio.get_running_loop()
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            figures = await loop.run_in_executor(pool, client, str(h.dra_socket), rounds)
        writes = h.metric("gpu_agent_dra_checkpoint_writes_total", result="ok")
    print(f"DRA prepare/unprepare over {h.dra_socket.name}, {rounds} rounds, checkpoint and CDI specs on {fs}")
    for key, samples in figures.items():
        print(f"  {key:13s} {percentiles(samples)}")
    print(f"  checkpoint writes: {writes:.0f} for {rounds * 4} prepare/unprepare calls that changed something")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    asyncio.run(main(args.rounds, fs_type(Path(tempfile.gettempdir()))))
