"""Time preferred_allocation per call: ``python bench/bench_preferred.py [--repeat N]``.

Node: 8 H100-like GPUs in two NVLink islands (0-3, 4-7), two NUMA nodes. The scorer is built
once, as the servicer would per inventory; its construction is timed on its own line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from itertools import combinations
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.core.inventory.model import Gpu, Inventory, Link, PcieLevel, link_key
from agent.deviceplugin.preferred import ReplicaPolicy, TopologyScorer, preferred_allocation


def islands_node() -> Inventory:
    gpus = tuple(
        Gpu(
            uuid=f"GPU-{i:02d}",
            index=i,
            minor=i,
            product_name="NVIDIA H100 80GB HBM3",
            architecture="hopper",
            compute_capability="9.0",
            memory_mib=81559,
            pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0",
            numa_node=i // 4,
        )
        for i in range(8)
    )
    links = {
        link_key(a.uuid, b.uuid): Link(4, PcieLevel.SINGLE if a.index // 2 == b.index // 2 else PcieLevel.NODE)
        for a, b in combinations(gpus, 2)
        if a.index // 4 == b.index // 4
    }
    return Inventory(backend="bench", driver_version="550.54", cuda_driver_version="12.4", gpus=gpus, links=links)


def timed(call: Callable[[], object], repeat: int) -> list[float]:
    for _ in range(min(repeat, 50)):
        call()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        call()
        samples.append((time.perf_counter_ns() - start) / 1000)
    return samples


def report(label: str, samples: list[float]) -> None:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    print(f"{label:<50} p50 {statistics.median(ordered):8.1f} us   p99 {p99:8.1f} us   max {ordered[-1]:8.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=2000)
    repeat = parser.parse_args().repeat
    inventory = islands_node()
    report("TopologyScorer(inventory), 8 GPUs", timed(lambda: TopologyScorer(inventory), repeat))
    scorer = TopologyScorer(inventory)

    policies: tuple[ReplicaPolicy, ...] = ("spread", "pack")
    whole = {g.uuid: g.uuid for g in inventory.gpus}
    available = sorted(whole)
    for policy in policies:
        for must in ([], ["GPU-05"]):
            for size in range(1, 9):
                label = f"whole 8 GPUs {policy:<6} size {size} must {len(must)}"
                report(label, timed(_call(available, must, size, whole, inventory, policy, scorer), repeat))

    replicas = {f"{g.uuid}::{r}": g.uuid for g in inventory.gpus for r in range(8)}
    devices = sorted(replicas)
    for policy in policies:
        for must in ([], ["GPU-05::3", "GPU-06::0"]):
            for size in (1, 8, 32, 63):
                if len(must) > size:
                    continue
                label = f"64 replicas {policy:<6} size {size:>2} must {len(must)}"
                report(label, timed(_call(devices, must, size, replicas, inventory, policy, scorer), repeat))
    label = "64 replicas spread size 32, scorer built per call"
    report(label, timed(_call(devices, [], 32, replicas, inventory, "spread", None), repeat))


def _call(
    available: list[str],
    must: list[str],
    size: int,
    gpu_of: dict[str, str],
    inventory: Inventory,
    policy: ReplicaPolicy,
    scorer: TopologyScorer | None,
) -> Callable[[], object]:
    def call() -> object:
        return preferred_allocation(
            available=available,
            must_include=must,
            size=size,
            gpu_of=gpu_of,
            inventory=inventory,
            replica_policy=policy,
            scorer=scorer,
        )

    return call


if __name__ == "__main__":
    main()
