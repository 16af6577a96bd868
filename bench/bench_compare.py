"""The agent as deployed, side by side with the floor of its stack; prints figures, asserts nothing.

Every server under test runs in a process of its own, and every client is grpcio in another one:

* **floor**: ``bench/floor.py``, a bare grpclib + betterproto server (pure-Python codec, stock
  asyncio loop: the stack as pinned) answering a canned ``AllocateResponse``: the same bytes the
  agent answered for the same request;
* **agent**: ``python -m agent run --simulated`` (the 8-GPU ``h100-8x-nvlink`` preset, default log
  level ``info`` written to a file, CDI enabled) registered with the fake kubelet of the tests, once
  per device-list strategy (``envvar``, ``volume-mounts``, ``cdi-annotations``, ``cdi-cri``).

For each strategy: Allocate p50/p99 with one caller, throughput with 32 callers, server CPU per
call (utime + stime from ``/proc/<pid>/stat`` over the measured calls), RSS, and the agent ÷ floor
ratios. Floor and agent take turns in short chunks (``--rounds``), so that a load that comes and
goes on a shared machine hits both alike. Also, per agent start: process start -> first Register
received by the fake kubelet.

Then two more agent processes, each with a fake API server (``tests/fake_apiserver.py``, in this
bench's process) for ResourceClaims and ResourceSlices:

* **both mechanisms, 8 GPUs** (GPUs 0-3 device plugin, 4-7 DRA): RSS once ready, and after a burst
  of 2,000 Allocates, 2,000 ListAndWatch streams opened and closed (in waves) and 200 DRA
  prepare/unprepare pairs;
* **DRA**: a simulated node with 65 GPUs, all DRA: NodePrepareResources of one claim and of a batch
  of 64 claims (each GET from the fake API server; CDI specs and the checkpoint fsynced on the
  temporary directory's file system), then their NodeUnprepareResources.

Usage: ``.venv/bin/python bench/bench_compare.py [--calls N] [--rounds N] [--strategies a,b]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import compare_client as client
from tests.fake_apiserver import NODE, FakeApiServer, write_kubeconfig
from tests.fake_kubelet import FakeKubelet
from tests.fake_podresources import FakePodResources

STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
RESOURCE = "nvidia.com/gpu"
PLUGIN_SOCKET = "gpu-node-agent-nvidia-gpu.sock"
DRIVER = "gpu-node-agent.nvidia.com"
CALLERS = 32
BATCH = 64
CLK_TCK = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parents[1]

T = TypeVar("T")


# --- /proc -----------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def until(condition: Callable[[], object], *, within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {within_s} s waiting for {what}")
        await asyncio.sleep(0.002)


# --- servers under test ------------------------------------------------------------------


@dataclass
class Server:
    """A server process under test and the CPU it spent on measured calls."""

    name: str
    proc: subprocess.Popen[bytes]
    socket: Path
    cpu_s: float = 0.0
    calls: int = 0
    one: list[float] = field(default_factory=list)
    many_calls: int = 0
    many_wall_s: float = 0.0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def floor_server(work: Path, response: bytes, *, loop: str = "asyncio", codec: str = "pure") -> Iterator[Server]:
    path = work / f"floor-{loop}-{codec}.sock"
    answer = work / "floor-response.bin"
    answer.write_bytes(response)
    args = [sys.executable, str(ROOT / "bench" / "floor.py"), str(path), str(answer), "--loop", loop]
    args += ["--codec", codec]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE)
    server = Server(f"floor ({loop}, {codec} codec)", proc, path)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the floor server did not start")
        yield server
    finally:
        server.stop()


@dataclass
class Agent:
    server: Server
    root: Path
    kubelet: FakeKubelet
    start_to_register_s: float
    #: CPU the agent had used when Register arrived (less sensitive to a shared machine's load)
    register_cpu_s: float
    start_to_ready_s: float
    debug_port: int

    def log_lines(self) -> int:
        return sum(1 for _ in (self.root / "agent.log").open("rb"))


#: the agent on the stack as pinned: the standard event loop, betterproto's own codec
STOCK_STACK = (
    "import runpy, sys; sys.modules['betterproto_rust_codec'] = None; "
    "runpy.run_module('agent', run_name='__main__', alter_sys=True)"
)


@contextlib.asynccontextmanager
async def agent_process(
    work: Path,
    name: str,
    config: str,
    *,
    args: tuple[str, ...] = (),
    register: bool = True,
    stock: bool = False,
    runner: str = "agent",
    extra_env: dict[str, str] | None = None,
) -> AsyncIterator[Agent]:
    """``python -m agent run --simulated`` in ``work/name`` with a fake kubelet; yields once ready.

    ``stock``: on the standard event loop and betterproto's own codec (what the floor runs on).
    ``runner``: the module ``-m`` runs (``bench.prepare_trace``, ``bench.import_rss``: the agent
    through a measuring shim), with ``extra_env``.
    """
    compile_bytecode()
    root = work / name
    kubelet_root = root / "k"
    plugin_dir = kubelet_root / "device-plugins"
    cdi_root = cdi_directory(work) / name
    for d in (plugin_dir, cdi_root, root / "state"):
        d.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(config)
    kubelet = FakeKubelet(plugin_dir)
    await kubelet.start()
    pod_resources = FakePodResources(kubelet_root / "pod-resources")  # no pod holds a GPU
    pod_resources.start_threaded()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_AGENT_")}
    if stock:
        env["GPU_AGENT_EVENT_LOOP"] = "asyncio"
    env.update(extra_env or {})
    command = [
        sys.executable,
        *(("-c", STOCK_STACK) if stock else ("-m", runner)),
        "run",
        "--simulated",
        "--config",
        str(root / "config.yaml"),
        "--kubelet-root",
        str(kubelet_root),
        "--cdi-root",
        str(cdi_root),
        "--state-dir",
        str(root / "state"),
        "--debug-addr",
        f"127.0.0.1:{port}",
        *args,
    ]
    if "--node-name" not in args:
        command += ["--node-name", NODE]
    log = (root / "agent.log").open("wb")
    started = time.monotonic()
    proc = await asyncio.to_thread(subprocess.Popen, command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    server = Server(f"agent ({name})", proc, plugin_dir / PLUGIN_SOCKET)
    try:
        register_s = register_cpu_s = 0.0
        if register:
            await until(lambda: kubelet.calls or proc.poll() is not None, within_s=30, what="Register")
            if proc.poll() is not None:
                raise RuntimeError(f"the agent exited: {(root / 'agent.log').read_text()[-2000:]}")
            register_s = kubelet.calls[0].at - started
            register_cpu_s = cpu_seconds(proc.pid)  # a few ms after the call reached the kubelet
            await until(lambda: kubelet.holds_live_stream(RESOURCE), within_s=30, what="the kubelet's stream")
        await until(lambda: _ready(port) or proc.poll() is not None, within_s=30, what="/readyz")
        if proc.poll() is not None:
            raise RuntimeError(f"the agent exited: {(root / 'agent.log').read_text()[-2000:]}")
        yield Agent(server, root, kubelet, register_s, register_cpu_s, time.monotonic() - started, port)
    finally:
        server.stop()
        log.close()
        await kubelet.stop()
        pod_resources.stop_threaded()


_compiled: list[Path] = []


def compile_bytecode(root: Path = ROOT, python: str = sys.executable) -> None:
    """Byte-compile the agent once, as the image does (``compileall`` in its Dockerfile): with
    ``PYTHONDONTWRITEBYTECODE`` set, as on this project's machines, an editable install would
    otherwise compile every module from source at every start, which is not what a node runs
    (start-up CPU, and the compiler's memory in RSS)."""
    if root in _compiled:
        return
    subprocess.run([python, "-m", "compileall", "-q", str(root / "agent")], check=True, stdout=subprocess.DEVNULL)
    _compiled.append(root)


def cdi_directory(work: Path) -> Path:
    """Where the agents' CDI specs go: a tmpfs when there is one, as ``/var/run/cdi`` is on a node
    (the state directory, with the DRA checkpoint, stays on the work directory's disk)."""
    shm = Path("/dev/shm")
    if fs_type(shm) == "tmpfs" and os.access(shm, os.W_OK):
        return shm / work.name
    return work / "cdi"


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return int(response.status) == 200
    except OSError:
        return False


# --- measuring -----------------------------------------------------------------------------


class Bench:
    def __init__(self, pool: ProcessPoolExecutor) -> None:
        self._pool = pool

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def load(self, server: Server, devices: list[str], callers: int, calls: int) -> None:
        cpu0 = cpu_seconds(server.pid)
        samples, wall = await self.call(client.allocate_load, str(server.socket), devices, callers, calls)
        server.cpu_s += cpu_seconds(server.pid) - cpu0
        server.calls += len(samples)
        if callers == 1:
            server.one += samples
        else:
            server.many_calls += len(samples)
            server.many_wall_s += wall


@dataclass(frozen=True)
class Figures:
    p50_ms: float
    p99_ms: float
    per_s: float
    cpu_ms: float
    rss_mib: float

    @classmethod
    def of(cls, server: Server) -> Figures:
        ordered = sorted(server.one)
        return cls(
            p50_ms=ordered[len(ordered) // 2] * 1000,
            p99_ms=ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000,
            per_s=server.many_calls / server.many_wall_s,
            cpu_ms=server.cpu_s / server.calls * 1000,
            rss_mib=rss_mib(server.pid),
        )

    def row(self, label: str) -> str:
        return (
            f"  {label:34s} {self.p50_ms:6.2f} {self.p99_ms:7.2f} {self.per_s:8.0f}"
            f" {self.cpu_ms:8.3f} {self.rss_mib:7.1f}"
        )


HEADER = f"  {'':34s} {'p50 ms':>6s} {'p99 ms':>7s} {'calls/s':>8s} {'CPU ms':>8s} {'RSS MiB':>7s}"


def plugin_config(strategy: str) -> str:
    return f"plugin: {{device_list_strategy: [{strategy}]}}\n"


async def compare_strategy(
    bench: Bench, work: Path, strategy: str, *, calls: int, rounds: int, extra_floors: bool, stock_agent: bool
) -> tuple[Figures, Figures, Agent]:
    async with contextlib.AsyncExitStack() as stack:
        agent = await stack.enter_async_context(agent_process(work, strategy, plugin_config(strategy)))
        devices = _plugin_devices(agent)
        response = await bench.call(client.allocate_once, str(agent.server.socket), devices[0])
        floor = stack.enter_context(floor_server(work, response))
        servers = [floor, agent.server]
        if stock_agent:
            stock = await stack.enter_async_context(
                agent_process(work, f"{strategy}-stock", plugin_config(strategy), stock=True)
            )
            stock.server.name = f"agent ({strategy}, stock loop+codec)"
            servers.append(stock.server)
        if extra_floors:
            servers.append(stack.enter_context(floor_server(work, response, loop="uvloop", codec="rust")))
        chunk = max(1, calls // rounds)
        for _ in range(rounds):
            for server in servers:
                await bench.load(server, devices, 1, chunk)
            for server in servers:
                await bench.load(server, devices, CALLERS, chunk)
        figures = [Figures.of(s) for s in servers]
        print(
            f"\n{strategy}: agent started -> Register {agent.start_to_register_s * 1000:.0f} ms"
            f" ({agent.register_cpu_s * 1000:.0f} ms CPU)"
        )
        print(HEADER)
        for server, figure in zip(servers, figures, strict=True):
            print(figure.row(server.name))
        f = figures[0]
        for server, a in zip(servers[1:], figures[1:], strict=True):
            print(
                f"  {'÷ floor: ' + server.name:34.34s} {a.p50_ms / f.p50_ms:6.2f} {a.p99_ms / f.p99_ms:7.2f}"
                f" {a.per_s / f.per_s:8.2f} {a.cpu_ms / f.cpu_ms:8.2f} {a.rss_mib / f.rss_mib:7.2f}"
            )
        print(f"  agent log lines written: {agent.log_lines()}")
        return f, figures[1], agent


def _plugin_devices(agent: Agent) -> list[str]:
    process = agent.kubelet.current
    assert process is not None
    return [d.ID for d in process.clients[RESOURCE].devices]


# --- DRA and both mechanisms ---------------------------------------------------------------


def claim_object(name: str, uid: str, device: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        "status": {
            "reservedFor": [{"resource": "pods", "name": f"pod-{name}", "uid": f"pod-{uid}"}],
            "allocation": {
                "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}]},
                "allocationTimestamp": "2026-12-01T00:00:00Z",
            },
        },
    }


def put_claims(api: FakeApiServer, rounds: int, gpus: list[int], namespace: str) -> None:
    """Claims r<round>-c<i> on device gpu-<gpus[i]>, as compare_client.dra_claims names them."""
    for r in range(rounds):
        for i, gpu in enumerate(gpus):
            api.put_claim(claim_object(f"r{r}-c{i}", f"uid-r{r}-c{i}", f"gpu-{gpu}", namespace))


def preset_file(path: Path, gpus: int) -> Path:
    lines = [
        f"name: bench-{gpus}",
        f"description: {gpus} simulated GPUs for the DRA benchmark",
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


async def register_dra(agent: Agent) -> None:
    from tests.dra_fakes import FakeKubelet as DraKubelet

    registration = agent.root / "k" / "plugins_registry" / f"{DRIVER}-reg.sock"
    await until(registration.exists, within_s=30, what="the DRA registration socket")
    await DraKubelet(registration).register()


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    p50 = ordered[len(ordered) // 2] * 1000
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000
    return f"p50 {p50:7.1f} ms  p99 {p99:7.1f} ms  max {ordered[-1] * 1000:7.1f} ms  (n={len(ordered)})"


async def dra_batches(bench: Bench, work: Path, rounds: int) -> None:
    api = await FakeApiServer().start()
    try:
        put_claims(api, rounds, list(range(BATCH + 1)), "bench")
        kubeconfig = write_kubeconfig(work, api.url, {"token": "t"})
        preset = preset_file(work / "bench-65.yaml", BATCH + 1)
        config = "ownership: {default: dra}\n"
        args = ("--kubeconfig", str(kubeconfig), "--preset", str(preset))
        async with agent_process(work, "dra", config, args=args, register=False) as agent:
            await register_dra(agent)
            await until(lambda: set(_owners(agent.debug_port)) == {"dra"}, within_s=30, what="every GPU granted to DRA")
            socket_path = agent.root / "k" / "plugins" / DRIVER / "dra.sock"
            figures = await bench.call(client.dra_prepare_rounds, str(socket_path), rounds, BATCH, "bench")
            print(f"\nDRA, agent process with a fake API server (claims GET over HTTP), {BATCH + 1} simulated GPUs,")
            print(
                f"checkpoint fsynced on {fs_type(agent.root)}, CDI specs on {fs_type(cdi_directory(work))};"
                f" {rounds} rounds on fresh claims"
            )
            for key, samples in figures.items():
                print(f"  {key:14s} {percentiles(samples)}")
            print(f"  agent RSS {rss_mib(agent.server.pid):.1f} MiB")
    finally:
        await api.stop()


async def both_mechanisms(bench: Bench, work: Path, *, allocates: int, streams: int, wave: int) -> None:
    api = await FakeApiServer().start()
    dra_pairs = 200
    try:
        put_claims(api, dra_pairs, [4], "rss")
        kubeconfig = write_kubeconfig(work, api.url, {"token": "t"})
        config = BOTH_CONFIG
        args = ("--kubeconfig", str(kubeconfig))
        async with agent_process(work, "both", config, args=args) as agent:
            await register_dra(agent)
            await until(lambda: _owners(agent.debug_port) == BOTH_OWNERS, within_s=30, what="GPUs 4-7 granted to DRA")
            await asyncio.sleep(1.0)
            pid = agent.server.pid
            ready_rss = rss_mib(pid)
            devices = _plugin_devices(agent)
            socket_path = str(agent.server.socket)
            await bench.call(client.allocate_load, socket_path, devices, CALLERS, allocates)
            answered = await bench.call(client.list_and_watch_waves, socket_path, streams, wave)
            dra_socket = str(agent.root / "k" / "plugins" / DRIVER / "dra.sock")
            await bench.call(dra_single_pairs, dra_socket, dra_pairs)
            await asyncio.sleep(2.0)
            after = rss_mib(pid)
            print(
                "\nboth mechanisms, 8 GPUs (4 device plugin with cdi-cri, 4 DRA), fake API server; start -> Register "
                f"{agent.start_to_register_s * 1000:.0f} ms, ready {agent.start_to_ready_s * 1000:.0f} ms"
            )
            print(f"  RSS when ready                      {ready_rss:6.1f} MiB")
            print(
                f"  RSS after {allocates} Allocates, {streams} ListAndWatch streams ({answered} answered, waves of "
                f"{wave}), {dra_pairs} DRA prepare/unprepare: {after:6.1f} MiB"
            )
    finally:
        await api.stop()


BOTH_CONFIG = f"""
plugin: {{device_list_strategy: [cdi-cri]}}
ownership:
  nodes:
    - match: {{names: [{NODE}]}}
      gpus: {{"4": dra, "5": dra, "6": dra, "7": dra}}
"""


BOTH_OWNERS = ["device-plugin"] * 4 + ["dra"] * 4


def _owners(port: int) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/debug/state", timeout=5) as response:
        state = json.loads(response.read())
    return [d["owner"] for d in sorted(state["devices"], key=lambda d: d["index"])]


def dra_single_pairs(socket_path: str, pairs: int) -> None:
    import grpc

    from tests._grpcio import dra_v1_pb2 as dra
    from tests._grpcio import dra_v1_pb2_grpc as dra_grpc

    with grpc.insecure_channel(f"unix://{socket_path}") as channel:
        stub = dra_grpc.DRAPluginStub(channel)
        for r in range(pairs):
            claims = client.dra_claims(r, 1, 0, "rss")
            for call, request in (
                (stub.NodePrepareResources, dra.NodePrepareResourcesRequest(claims=claims)),
                (stub.NodeUnprepareResources, dra.NodeUnprepareResourcesRequest(claims=claims)),
            ):
                response = call(request, timeout=45)
                errors = [c.error for c in response.claims.values() if c.error]
                if errors:
                    raise RuntimeError(errors[0])


def fs_type(path: Path) -> str:
    best, kind = "", "unknown"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) > 2 and str(path).startswith(fields[1]) and len(fields[1]) > len(best):
                best, kind = fields[1], fields[2]
    return kind


# --- main --------------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> None:
    strategies = [s for s in args.strategies.split(",") if s]
    print(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; grpcio client in its own process; "
        f"{args.calls} calls per server and caller count"
    )
    work = Path(tempfile.mkdtemp(prefix="bc-", dir="/tmp"))
    registers: list[float] = []
    register_cpu: list[float] = []
    ratios: list[tuple[str, float, float]] = []
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            bench = Bench(pool)
            for strategy in strategies:
                floor, agent, run = await compare_strategy(
                    bench,
                    work,
                    strategy,
                    calls=args.calls,
                    rounds=args.rounds,
                    extra_floors=args.extra_floors,
                    stock_agent=args.stock_agent,
                )
                registers.append(run.start_to_register_s)
                register_cpu.append(run.register_cpu_s)
                ratios.append((strategy, agent.p50_ms / floor.p50_ms, agent.per_s / floor.per_s))
            if not args.skip_mechanisms:
                await both_mechanisms(bench, work, allocates=2000, streams=2000, wave=args.wave)
                await dra_batches(bench, work, args.dra_rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(cdi_directory(work), ignore_errors=True)
    print("\nsummary (goals: p50 ratio <= 1.1, throughput ratio >= 0.85, start -> Register < 500 ms)")
    for strategy, p50, per_s in ratios:
        print(f"  {strategy:16s} p50 ratio {p50:5.2f}   throughput ratio {per_s:5.2f}")
    if registers:
        print(
            f"  start -> Register: median {statistics.median(registers) * 1000:.0f} ms"
            f" ({statistics.median(register_cpu) * 1000:.0f} ms CPU) over {len(registers)} starts"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000, help="Allocate calls per server, per caller count")
    parser.add_argument("--rounds", type=int, default=3, help="turns the servers take (calls split between them)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--extra-floors", action="store_true", help="also a floor on uvloop with the Rust codec")
    parser.add_argument(
        "--stock-agent", action="store_true", help="also the agent on the standard loop and betterproto's own codec"
    )
    parser.add_argument("--skip-mechanisms", action="store_true", help="only the strategies, no DRA/RSS runs")
    parser.add_argument("--dra-rounds", type=int, default=20)
    parser.add_argument(
        "--wave",
        type=int,
        default=7,
        help="ListAndWatch streams open at once in the burst (under a cap of 8, the kubelet holds one)",
    )
    asyncio.run(main(parser.parse_args()))
