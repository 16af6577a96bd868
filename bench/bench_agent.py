"""Steady-state RSS and idle CPU of ``gpu-agent run`` on the 8-GPU simulated preset.

Runs the agent as a real process in a temporary root (device plugin serving against a fake
kubelet, env-only CDI specs reconciled in the temporary CDI root), waits until it is ready,
lets it settle, then samples /proc for a while. Prints the figures; asserts nothing.

    python bench/bench_agent.py [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.agentproc import AgentProcess
from tests.test_plugin_fakes import FakeKubelet

CLK_TCK = os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


async def measure(seconds: float, settle: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = root / "config.yaml"
        config.write_text("plugin: {device_list_strategy: [envvar, cdi-cri]}\n")
        kubelet = FakeKubelet(root / "kubelet" / "device-plugins")
        await kubelet.start()
        agent = AgentProcess(root, ["--simulated", "--config", str(config)])
        try:
            t0 = time.monotonic()
            await asyncio.to_thread(agent.wait_ready, 30)
            ready_s = time.monotonic() - t0
            await asyncio.sleep(settle)
            pid = agent.proc.pid
            cpu0, wall0 = cpu_seconds(pid), time.monotonic()
            samples = []
            while time.monotonic() - wall0 < seconds:
                samples.append(rss_mib(pid))
                await asyncio.sleep(1.0)
            cpu = (cpu_seconds(pid) - cpu0) / (time.monotonic() - wall0) * 100
            print("gpu-agent run --simulated (h100-8x-nvlink, 8 GPUs)")
            print("  device plugin registered with a fake kubelet, CDI specs reconciled")
            print(f"  Register calls        {len(kubelet.calls)}")
            print(f"  start to ready        {ready_s:.2f} s")
            print(f"  steady RSS            {max(samples):.1f} MiB (max of {len(samples)} samples)")
            print(f"  idle CPU              {cpu:.2f} % of one core over {seconds:.0f} s")
            await asyncio.to_thread(agent.terminate)
        finally:
            agent.kill()
            await kubelet.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--settle", type=float, default=3.0)
    args = parser.parse_args()
    asyncio.run(measure(args.seconds, args.settle))


if __name__ == "__main__":
    main()
