"""Resident memory of the agent as deployed, by imported package; prints figures, asserts nothing.

The agent runs as its own process with both mechanisms (GPUs 0-3 device plugin with ``cdi-cri``,
4-7 DRA; a fake kubelet and a fake API server over HTTPS, as ``bench_compare.py`` does), through
``bench/import_rss.py``, which weighs every module as it is imported. Once ready it gets the burst
of ``bench_compare.py`` (2,000 Allocates, 2,000 ListAndWatch streams in waves of 7, 200 DRA
prepare/unprepare pairs); then VmRSS is read, the agent stopped, and the import weights printed by
package, with what is left over: the heap the running agent holds (objects, buffers, allocator
arenas). The per-module weights come from importing the same modules again, in the same order, in
a process that does nothing else (see ``import_rss.py``).

Usage: ``.venv/bin/python bench/bench_memory.py [--no-burst] [--top N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import compare_client as client
from bench.bench_compare import (
    BOTH_CONFIG,
    BOTH_OWNERS,
    CALLERS,
    DRIVER,
    ROOT,
    Bench,
    _owners,
    _plugin_devices,
    agent_process,
    dra_single_pairs,
    put_claims,
    register_dra,
    rss_mib,
    until,
)
from bench.bench_prepare import https_api


def package_of(module: str) -> str:
    """``agent.<room>`` for the agent's own modules, else the top-level package."""
    parts = module.split(".")
    if parts[0] == "agent" and len(parts) > 1:
        return ".".join(parts[:2])
    if parts[0] in sys.stdlib_module_names or parts[0].lstrip("_") in sys.stdlib_module_names:
        return f"stdlib {parts[0].lstrip('_')}"
    return parts[0]


def table(document: dict[str, object], steady_mib: float, top: int) -> None:
    modules = document["modules"]
    assert isinstance(modules, list)
    kib: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for row in modules:
        kib[package_of(row["name"])] += row["kib"]
        count[package_of(row["name"])] += 1
    imported = sum(kib.values()) / 1024
    stdlib = sum(v for k, v in kib.items() if k.startswith("stdlib ")) / 1024
    print(f"\nVmRSS after the burst {steady_mib:.1f} MiB = imports {imported:.1f} + heap of the running agent")
    print(f"{steady_mib - imported:.1f} (objects, buffers, arenas). Imports by package (MiB, modules):")
    print(f"  {'all of the standard library':40s} {stdlib:6.2f}")
    shown = [(k, v) for k, v in kib.most_common() if not k.startswith("stdlib ")][:top]
    for name, value in shown:
        print(f"  {name:40s} {value / 1024:6.2f} {count[name]:4d}")
    print("  standard library, largest:")
    for name, value in [(k, v) for k, v in kib.most_common() if k.startswith("stdlib ")][:8]:
        print(f"    {name[7:]:38s} {value / 1024:6.2f} {count[name]:4d}")


async def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bm-", dir="/tmp"))
    out = work / "imports.json"
    try:
        pairs = 200
        async with https_api(work) as (api, kubeconfig):
            put_claims(api, pairs, [4], "rss")
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                bench = Bench(pool)
                async with agent_process(
                    work,
                    "memory",
                    BOTH_CONFIG,
                    args=("--kubeconfig", str(kubeconfig)),
                    runner="bench.import_rss",
                    extra_env={"IMPORT_RSS": str(out)},
                ) as agent:
                    await register_dra(agent)
                    await until(lambda: _owners(agent.debug_port) == BOTH_OWNERS, within_s=30, what="GPUs 4-7 to DRA")
                    await asyncio.sleep(1.0)
                    ready = rss_mib(agent.server.pid)
                    if not args.no_burst:
                        socket = str(agent.server.socket)
                        await bench.call(client.allocate_load, socket, _plugin_devices(agent), CALLERS, 2000)
                        await bench.call(client.list_and_watch_waves, socket, 2000, 7)
                        dra_socket = str(agent.root / "k" / "plugins" / DRIVER / "dra.sock")
                        await bench.call(dra_single_pairs, dra_socket, pairs)
                        await asyncio.sleep(2.0)
                    steady = rss_mib(agent.server.pid)
                    print(f"python {sys.version.split()[0]}; load average {os.getloadavg()[0]:.2f}")
                    print(f"VmRSS when ready {ready:.1f} MiB, after the burst {steady:.1f} MiB")
        clean = work / "replayed.json"
        await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "bench.import_rss", "--replay", str(out)],
            env={**os.environ, "IMPORT_RSS": str(clean)},
            cwd=ROOT,
            check=True,
        )
        table(json.loads(clean.read_text()), steady, args.top)
        if args.save:
            shutil.copy(clean, args.save)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-burst", action="store_true", help="weigh the agent once ready, without the burst")
    parser.add_argument("--top", type=int, default=30, help="packages shown")
    parser.add_argument("--save", help="keep the per-module figures (JSON) in this file")
    asyncio.run(main(parser.parse_args()))
