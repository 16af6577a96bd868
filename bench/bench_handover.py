"""DRA and handover timings of the agent as deployed: a real process on the 8-GPU simulated
preset, both mechanisms serving (GPUs 0-3 to DRA, 4-7 to the device plugin), with a fake
kubelet (device-plugin registration, PodResources), the plugin watcher's DRA handshake and the
fake API server. Prints the figures; asserts nothing.

* steady state: API writes over a quiet period, as writes per hour (must be 0);
* health change -> the ResourceSlice updated (the unhealthy device leaves or is tainted);
* an idle GPU moved by the config, device plugin -> DRA: config written -> in a slice;
* a GPU held by a pod: the pod ends (PodResources stops listing it) -> in a slice;
* RSS of the agent with both mechanisms serving.

    python bench/bench_handover.py [--rounds 5] [--quiet-s 30]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from tests._grpcio import pluginregistration_v1_pb2 as reg_pb
from tests._grpcio import pluginregistration_v1_pb2_grpc as reg_grpc
from tests.agentproc import AgentProcess
from tests.fake_apiserver import NODE, FakeApiServer, write_kubeconfig
from tests.fake_podresources import FakePodResources
from tests.test_plugin_fakes import FakeKubelet, short_tmpdir

DRIVER = "gpu-node-agent.nvidia.com"
BASE = """
health: {check_interval_s: 1}
ownership:
  default: device-plugin
  nodes:
    - match: {names: [NODE]}
      gpus: GPUS
"""


def config_text(dra: list[int]) -> str:
    return BASE.replace("NODE", NODE).replace("GPUS", "{" + ", ".join(f'"{i}": dra' for i in dra) + "}")


async def until(predicate: Callable[[], bool], within_s: float = 30.0) -> float:
    """Seconds until ``predicate`` holds (polled every 5 ms)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > within_s:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.005)
    return time.monotonic() - start


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def register(registry: Path) -> None:
    async with asyncio.timeout(30):
        while True:
            try:
                async with grpc.aio.insecure_channel(f"unix://{registry}") as channel:
                    stub = reg_grpc.RegistrationStub(channel)
                    await stub.GetInfo(reg_pb.InfoRequest(), timeout=1)
                    await stub.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), timeout=5)
                    return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)


def published(api: FakeApiServer) -> dict[str, dict[str, object]]:
    return {d["name"]: d for s in api.slices_of() if s["spec"]["driver"] == DRIVER for d in s["spec"]["devices"]}


def summary(name: str, values: list[float]) -> str:
    if not values:
        return f"{name}: no samples"
    return f"{name}: p50 {statistics.median(values) * 1000:.0f} ms, max {max(values) * 1000:.0f} ms (n={len(values)})"


async def main(rounds: int, quiet_s: float) -> None:
    api = await FakeApiServer().start()
    with short_tmpdir() as root:
        config = root / "config.yaml"
        config.write_text(config_text([0, 1, 2, 3]))
        kubelet = FakeKubelet(root / "kubelet" / "device-plugins")
        await kubelet.start()
        pods = FakePodResources(root / "kubelet" / "pod-resources")
        await pods.start()
        args = ["--simulated", "--config", str(config), "--kubeconfig", str(write_kubeconfig(root, api.url))]
        agent = AgentProcess(root, [*args, "--node-name", NODE])
        try:
            await asyncio.to_thread(agent.wait_port, 30)
            await register(agent.kubelet_root / "plugins_registry" / f"{DRIVER}-reg.sock")
            await until(lambda: set(published(api)) == {"gpu-0", "gpu-1", "gpu-2", "gpu-3"})
            uuids = [d["uuid"] for d in sorted(agent.state()["devices"], key=lambda d: d["index"])]
            await asyncio.sleep(2)  # settle: first lists, registrations, health checks

            writes = api.slice_writes()
            await asyncio.sleep(quiet_s)
            steady = (api.slice_writes() - writes) * 3600 / quiet_s
            print(f"steady state: {steady:.0f} slice writes per hour (over {quiet_s:.0f} s)")
            print(f"RSS with both mechanisms serving 8 GPUs: {rss_mib(agent.proc.pid):.1f} MiB")

            health, idle, held = [], [], []
            for _ in range(rounds):
                # health change -> slice updated
                before = published(api)["gpu-1"]
                status, _body = agent.post("/debug/simulated/health", {"device": "1", "healthy": False, "xid": 79})
                assert status == 200
                health.append(await until(lambda before=before: published(api).get("gpu-1") != before))
                agent.post("/debug/simulated/health", {"device": "1", "healthy": True})
                await until(lambda before=before: published(api).get("gpu-1") == before)

                # an idle GPU: device plugin -> DRA
                start = time.monotonic()
                config.write_text(config_text([0, 1, 2, 3, 4]))
                await until(lambda: "gpu-4" in published(api))
                idle.append(time.monotonic() - start)

                # a GPU held by a pod: the pod ends -> in a slice
                pods.allocate("ml", "train", "main", "nvidia.com/gpu", [uuids[5]])
                await asyncio.sleep(1.5)  # the agent has seen the pod
                config.write_text(config_text([0, 1, 2, 3, 4, 5]))

                # past closing (the plugin no longer lists it): now only the pod holds it
                def held_by_the_pod() -> bool:
                    drain = agent.state()["devices"][5]["draining"] or {}
                    return "in use" in str(drain.get("waiting_for", ""))

                await until(held_by_the_pod)
                start = time.monotonic()
                pods.release("ml", "train")
                await until(lambda: "gpu-5" in published(api))
                held.append(time.monotonic() - start)

                config.write_text(config_text([0, 1, 2, 3]))  # back, for the next round
                await until(lambda: not {"gpu-4", "gpu-5"} & set(published(api)))
                await until(lambda: all(d["owner"] == "device-plugin" for d in agent.state()["devices"][4:]))

            print(summary("health change -> ResourceSlice updated", health))
            print(summary("idle GPU, config written -> in a ResourceSlice", idle))
            print(summary("held GPU, pod ended -> in a ResourceSlice", held))
        finally:
            agent.kill()
            await pods.stop()
            await kubelet.stop()
            await api.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quiet-s", type=float, default=30.0)
    options = parser.parse_args()
    asyncio.run(main(options.rounds, options.quiet_s))
