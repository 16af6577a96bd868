"""Agent restarts as the kubelet sees them: process start -> devices offered to the kubelet.

Runs ``gpu-agent run --simulated`` (8 GPUs, default log level, as deployed: its own process, the
console script) against the fake kubelet of the tests (grpcio, threaded, as the Go kubelet) and a
fake PodResources API, in a temporary root whose state directory survives the restarts. Each
round stops the agent (SIGKILL or SIGTERM), waits until the kubelet has marked its devices
unhealthy, starts it again and measures, from the moment the process is spawned:

* Register received by the kubelet;
* the first ListAndWatch message (and how many devices it carried: an empty one is the kubelet
  being told "no GPUs here");
* the kubelet holding every GPU as healthy (what it admits pods against; polled every 2 ms).

The first start (a fresh node: no record of earlier grants) is reported on its own. Prints the
figures; asserts nothing.

    python bench/bench_restart.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fake_kubelet import FakeKubelet, KubeletProcess
from tests.fake_podresources import FakePodResources

RESOURCE = "nvidia.com/gpu"
GPUS = 8
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Start:
    register_s: float
    first_list_s: float
    first_list_devices: int
    all_offered_s: float
    cpu_s: float


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def agent_command(root: Path) -> list[str]:
    script = Path(sys.executable).with_name("gpu-agent")
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "agent"]
    return [
        *launcher,
        "run",
        "--simulated",
        "--config",
        str(root / "config.yaml"),
        "--kubelet-root",
        str(root / "kubelet"),
        "--cdi-root",
        str(root / "cdi"),
        "--state-dir",
        str(root / "state"),
        "--debug-addr",
        "127.0.0.1:0",
        "--node-name",
        "bench-node",
    ]


async def until(condition: object, within_s: float = 30.0, step: float = 0.002) -> None:
    deadline = time.monotonic() + within_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError("gave up waiting")
        await asyncio.sleep(step)


async def start_agent(root: Path, kubelet: FakeKubelet) -> tuple[subprocess.Popen[bytes], Start]:
    process = kubelet.current
    assert process is not None
    calls, clients = len(process.calls), len(process.all_clients)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_AGENT_")}
    log = (root / "agent.log").open("ab")
    started = time.monotonic()
    proc = await asyncio.to_thread(subprocess.Popen, agent_command(root), stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()

    def offered(p: KubeletProcess = process) -> bool:
        return p.allocatable(RESOURCE) == GPUS and len(p.all_clients) > clients

    await until(offered)
    all_offered = time.monotonic() - started
    cpu = cpu_seconds(proc.pid)
    with process.lock:
        register = process.calls[calls].at - started
        client = process.all_clients[clients]
        first = (client.opened_at or 0.0) - started
        devices = client.counts[0]
    return proc, Start(register, first, devices, all_offered, cpu)


async def stop_agent(proc: subprocess.Popen[bytes], how: str, kubelet: FakeKubelet) -> None:
    proc.send_signal(signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM)
    await asyncio.to_thread(proc.wait, 30)
    process = kubelet.current
    assert process is not None
    await until(lambda: process.allocatable(RESOURCE) == 0)


def row(label: str, starts: list[Start]) -> str:
    def figures(values: list[float]) -> str:
        return f"p50 {statistics.median(values) * 1000:5.0f} ms, max {max(values) * 1000:5.0f} ms"

    counts = sorted({s.first_list_devices for s in starts})
    return (
        f"{label:9} n={len(starts)}\n"
        f"    start -> Register                 {figures([s.register_s for s in starts])}\n"
        f"    start -> first ListAndWatch        {figures([s.first_list_s for s in starts])}"
        f"  (devices in it: {', '.join(map(str, counts))})\n"
        f"    start -> kubelet has all {GPUS} GPUs   {figures([s.all_offered_s for s in starts])}\n"
        f"    CPU used by then                  {figures([s.cpu_s for s in starts])}"
    )


async def main(rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="br-", dir="/tmp") as tmp:
        root = Path(tmp)
        for d in ("kubelet/device-plugins", "cdi", "state"):
            (root / d).mkdir(parents=True)
        (root / "config.yaml").write_text("ownership: {default: device-plugin}\n")
        kubelet = FakeKubelet(root / "kubelet" / "device-plugins")
        await kubelet.start()
        pods = FakePodResources(root / "kubelet" / "pod-resources")  # no pod holds a GPU
        pods.start_threaded()
        proc: subprocess.Popen[bytes] | None = None
        try:
            proc, fresh = await start_agent(root, kubelet)
            results: dict[str, list[Start]] = {"SIGKILL": [], "SIGTERM": []}
            for _ in range(rounds):
                for how in results:
                    await asyncio.sleep(1.0)  # let the agent settle before it is stopped
                    await stop_agent(proc, how, kubelet)
                    proc, start = await start_agent(root, kubelet)
                    results[how].append(start)
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            pods.stop_threaded()
            await kubelet.stop()
        print(f"gpu-agent run --simulated ({GPUS} GPUs, default log level) against the fake kubelet")
        print(row("fresh", [fresh]))
        for how, starts in results.items():
            print(row(how, starts))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(main(parser.parse_args().rounds))
