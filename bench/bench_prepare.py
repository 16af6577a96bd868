"""Where a NodePrepareResources spends its time, in the agent as deployed; prints figures, asserts nothing.

The agent runs as its own process (``run --simulated``, 8 GPUs all owned by DRA, default log level,
CDI on) through ``bench/prepare_trace.py``, which times the phases of each prepare call. Claims come
from a fake API server over HTTPS (a self-signed certificate, so the TLS client path runs as in a
cluster) in this bench's process; the kubelet is a grpcio client in another process. The checkpoint
and, unless ``--cdi-tmpfs``, the CDI specs are on the work directory's disk (as on the peers
harness; on a node ``/var/run/cdi`` is a tmpfs).

Per call size (1 claim, 8 claims), on fresh claims each round: the client's latency, the handler's
wall time, and per phase the median wall time over the calls (a phase nested in another is
included in both; see ``prepare_trace.py`` for the names).

Usage: ``.venv/bin/python bench/bench_prepare.py [--rounds N] [--sizes 1,8] [--cdi-tmpfs] [--fake-driver]``
(``--fake-driver``: the CDI specs of an installed driver, from a fake driver tree, instead of the
simulated GPUs' environment-only specs).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import multiprocessing
import os
import shutil
import ssl
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import compare_client as client
from bench.bench_compare import (
    DRIVER,
    Bench,
    _owners,
    agent_process,
    claim_object,
    fs_type,
    register_dra,
    until,
)
from tests.cdi_fixtures import FakeDriver
from tests.fake_apiserver import FakeApiServer, write_kubeconfig
from tests.selfsigned import self_signed

NAMESPACE = "prep"


@contextlib.asynccontextmanager
async def https_api(work: Path) -> AsyncIterator[tuple[FakeApiServer, Path]]:
    """A fake API server over HTTPS (a self-signed certificate, so the agent's TLS client path runs
    as in a cluster) and a kubeconfig that trusts it."""
    cert, key = self_signed(work)
    server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ssl.load_cert_chain(cert, key)
    api = await FakeApiServer().start(server_ssl)
    try:
        ca = base64.b64encode(cert.read_bytes()).decode()
        yield api, write_kubeconfig(work, api.url, {"token": "t"}, **{"certificate-authority-data": ca})
    finally:
        await api.stop()


def median_table(lines: list[dict[str, Any]], client_ms: list[float], label: str) -> None:
    print(f"\n{label}: {len(lines)} calls; medians (ms)")
    print(f"  {'client (grpcio) latency':44s} {statistics.median(client_ms):7.2f}")
    print(f"  {'handler wall':44s} {statistics.median(x['handler_ms'] for x in lines):7.2f}")
    names = sorted({n for x in lines for n in x["phases"]})
    rows = []
    for name in names:
        walls = [x["phases"].get(name, {}).get("wall_ms", 0.0) for x in lines]
        sums = [x["phases"].get(name, {}).get("sum_ms", 0.0) for x in lines]
        count = statistics.median(x["phases"].get(name, {}).get("n", 0) for x in lines)
        rows.append((name, statistics.median(walls), statistics.median(sums), count))
    print(f"  {'phase':44s} {'wall':>7s} {'sum':>7s} {'n':>4s}")
    for name, wall, total, count in sorted(rows):
        print(f"  {name:44s} {wall:7.2f} {total:7.2f} {count:4.0f}")


async def main(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",") if s]
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    work = Path(tempfile.mkdtemp(prefix="bp-", dir=args.work_dir))
    try:
        async with https_api(work) as (api, kubeconfig):
            for r in range(args.rounds):
                for size in sizes:
                    for i in range(size):
                        name = f"r{r}s{size}-c{i}"
                        api.put_claim(claim_object(name, f"uid-{name}", f"gpu-{i}", NAMESPACE))
            trace = work / "trace.jsonl"
            config = "ownership: {default: dra}\n"
            agent_args: tuple[str, ...] = ("--kubeconfig", str(kubeconfig))
            if not args.cdi_tmpfs:  # the last --cdi-root given wins
                agent_args += ("--cdi-root", str(work / "cdi-disk"))
            if args.fake_driver:  # specs from an installed driver's files, as on a GPU node
                driver = FakeDriver(work / "driver", gpu_minors=tuple(range(8))).build()
                agent_args += ("--driver-root", str(driver.root))
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                bench = Bench(pool)
                async with agent_process(
                    work,
                    "prep",
                    config,
                    args=agent_args,
                    register=False,
                    runner="bench.prepare_trace",
                    extra_env={"PREPARE_TRACE": str(trace)},
                ) as agent:
                    await register_dra(agent)
                    await until(lambda: set(_owners(agent.debug_port)) == {"dra"}, within_s=30, what="DRA owns all")
                    socket_path = agent.root / "k" / "plugins" / DRIVER / "dra.sock"
                    latencies = await bench.call(
                        client.dra_prepare_sizes, str(socket_path), args.rounds, sizes, NAMESPACE
                    )
        lines = [json.loads(x) for x in trace.read_text().splitlines() if x.strip()]
        lines = [x for x in lines if "driver: whole batch" in x["phases"]]  # not the warm-up call
        print(
            f"checkpoint on {fs_type(work)}, CDI specs on {'tmpfs' if args.cdi_tmpfs else fs_type(work)}, "
            f"driver {'installed (fake tree)' if args.fake_driver else 'simulated (env-only specs)'}"
        )
        for size in sizes:
            mine = [x for x in lines if x["phases"].get("claim: read (GET + decode)", {}).get("n") == size]
            median_table(mine, [s * 1000 for s in latencies[f"prepare {size}"]], f"prepare {size}")
            unprepare = statistics.median(latencies[f"unprepare {size}"]) * 1000
            print(f"  unprepare {size}: client median {unprepare:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sizes", default="1,8")
    parser.add_argument("--cdi-tmpfs", action="store_true", help="CDI specs on a tmpfs, as /var/run/cdi is")
    parser.add_argument("--work-dir", default="/tmp", help="where the checkpoint (and CDI specs) go")
    parser.add_argument(
        "--fake-driver",
        action="store_true",
        help="a fake installed driver under the driver root (libraries, utilities, device nodes): "
        "specs as on a GPU node, not the simulated env-only ones",
    )
    asyncio.run(main(parser.parse_args()))
