"""Where the milliseconds of a NodePrepareResources go, inside the agent as deployed.

Run the agent through this module instead of ``python -m agent`` and it behaves exactly as the
agent does (same loop, same codec, same log level), except that a handful of functions on the
prepare path are wrapped with a clock::

    PREPARE_TRACE=/tmp/trace.jsonl python -m bench.prepare_trace run --simulated ...

Each NodePrepareResources call appends one JSON line to ``$PREPARE_TRACE``: the handler's wall
time and, per phase, the time spent in it (``sum``: added over the call's claims; ``wall``: the
union of the intervals, what the phase cost the call when its claims ran concurrently).
``bench/bench_prepare.py`` and ``bench/bench_peers.py`` (with ``--trace``) run the agent this
way and print the table. The wrappers cost a few microseconds per phase; figures are for finding
where time goes, not for the comparison itself (that runs the agent without this module).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import os
import runpy
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

#: the spans of the call being traced; None outside a NodePrepareResources call
_SPANS: contextvars.ContextVar[list[tuple[str, float, float]] | None] = contextvars.ContextVar(
    "prepare_trace", default=None
)
_lock = threading.Lock()


def _record(name: str, started: float) -> None:
    spans = _SPANS.get()
    if spans is not None:
        with _lock:
            spans.append((name, started, time.perf_counter()))


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                _record(name, started)

        return timed_async

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _record(name, started)

    return timed


def _wrap(owner: Any, attribute: str, name: str) -> None:
    original = getattr(owner, attribute, None)
    if original is None:
        print(f"prepare_trace: {owner.__name__}.{attribute} not found, not traced", file=sys.stderr)
        return
    setattr(owner, attribute, _timed(name, original))


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _handler(fn: Callable[..., Any], out: TextIO) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def traced(self: Any, stream: Any) -> None:
        spans: list[tuple[str, float, float]] = []
        token = _SPANS.set(spans)
        started = time.perf_counter()
        try:
            await fn(self, stream)
        finally:
            ended = time.perf_counter()
            _SPANS.reset(token)
            phases: dict[str, dict[str, float]] = {}
            by_name: dict[str, list[tuple[float, float]]] = {}
            for name, a, b in spans:
                by_name.setdefault(name, []).append((a, b))
            for name, intervals in by_name.items():
                phases[name] = {
                    "sum_ms": sum(b - a for a, b in intervals) * 1000,
                    "wall_ms": _union(intervals) * 1000,
                    "n": len(intervals),
                }
            line = {"at": time.time(), "handler_ms": (ended - started) * 1000, "phases": phases}
            out.write(json.dumps(line) + "\n")  # line-buffered: one small write per call

    return traced


def install(path: str) -> None:
    """Wrap the prepare path's functions (imports the modules concerned); lines go to ``path``."""
    import logging

    out = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (open for the process's life)

    from agent.base import atomicfile
    from agent.cdi import service as cdi_service
    from agent.cdi import writer as cdi_writer
    from agent.dra import modes
    from agent.dra.claims import checkpoint, driver, instances, prepared, shares, specwriter
    from agent.dra.kubelet import servicer
    from agent.kube import client as kube_client
    from agent.kube import http as kube_http
    from agent.kube.claims import source

    servicer.DraPluginServicer.node_prepare_resources = _handler(  # type: ignore[method-assign]
        servicer.DraPluginServicer.node_prepare_resources, out
    )
    _wrap(servicer, "received", "grpc: receive + decode request")
    _wrap(driver.DraDriver, "_prepare_batch", "driver: whole batch")
    _wrap(driver.DraDriver, "_read_claim", "claim: read (GET + decode)")
    _wrap(kube_client.KubeClient, "_call", "claim: HTTP GET")
    _wrap(kube_http.HttpPool, "_connect", "claim: HTTP GET: new connection (TCP, TLS)")
    _wrap(source, "parse_claim", "claim: decode JSON -> ResourceClaim")
    _wrap(driver, "plan_claim", "plan_claim")
    _wrap(instances.InstanceMaker, "make", "driver: MIG instances")
    _wrap(shares.MpsShares, "setup", "driver: MPS shares")
    _wrap(driver.DraDriver, "_write_specs", "driver: specs + checkpoint")
    _wrap(modes.ModeGate, "refresh", "driver: device shapes refreshed")
    _wrap(specwriter.ClaimSpecWriter, "write", "CDI: awaited")
    _wrap(cdi_service.CdiService, "_write_claims", "CDI: in thread")
    _wrap(cdi_writer.SpecWriter, "_check_conflicts", "CDI: conflict check")
    _wrap(cdi_writer, "atomic_write", "CDI: atomic write (file)")
    _wrap(cdi_writer.SpecWriter, "sync_directory", "CDI: directory fsync")
    _wrap(prepared.PreparedClaims, "persist", "checkpoint: awaited")
    _wrap(checkpoint.CheckpointStore, "write", "checkpoint: in thread")
    _wrap(checkpoint, "encode", "checkpoint: encode")
    _wrap(atomicfile, "fsync_directory", "fsync: directory (any)")
    _wrap(atomicfile.os, "fsync", "fsync: file (any)")
    _wrap(atomicfile.os, "fdatasync", "fdatasync (any)")
    _wrap(logging.Handler, "handle", "logging: handler")


def main() -> None:
    out = os.environ.get("PREPARE_TRACE", "")
    if not out:
        raise SystemExit("set PREPARE_TRACE to the file the trace lines go to")
    install(out)
    sys.argv[0] = "gpu-agent"
    runpy.run_module("agent", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
