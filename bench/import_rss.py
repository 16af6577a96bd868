"""What each imported module costs in resident memory, measured inside the agent as deployed.

Run the agent through this module instead of ``python -m agent``::

    IMPORT_RSS=/tmp/imports.json python -m bench.import_rss run --simulated ...

Every module the process imports is timed and weighed as it loads: the growth of VmRSS while its
own code ran, minus what the modules it imported meanwhile cost (so each byte counts once, for
the module whose import brought it in: shared libraries it maps, objects its top-level code
made). On exit (SIGTERM included) the agent writes ``$IMPORT_RSS``: per module its own KiB and
milliseconds, in import order, and the module whose import brought it in.

In the agent, phase 2 is imported in a worker thread while the loop serves, so memory the loop
takes meanwhile is charged to whatever module is loading. ``python -m bench.import_rss --replay
FILE`` imports the same modules again, in the same order, in a process doing nothing else, and
writes clean figures to ``$IMPORT_RSS``. ``bench/bench_memory.py`` does both and prints the table
by package.

RSS moves in pages and the allocator takes memory in arenas, so one small module can carry an
arena that later modules fill: figures per package are good to a few hundred KiB.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import runpy
import sys
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any


def rss_kib() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


class _Measure:
    def __init__(self) -> None:
        #: (module, own KiB, own ms, the module whose import brought it in), in the order the
        #: imports finished
        self.rows: list[tuple[str, int, float, str]] = []
        #: per import in progress: [KiB, ms] taken by nested imports
        self.stack: list[list[float]] = []
        #: the modules being imported, outermost first
        self.names: list[str] = []


_M = _Measure()


class _TimedLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        nested = [0.0, 0.0]
        parent = _M.names[-1] if _M.names else ""
        _M.stack.append(nested)
        _M.names.append(module.__name__)
        rss0, t0 = rss_kib(), time.perf_counter()
        try:
            self._inner.exec_module(module)
        finally:
            rss, ms = rss_kib() - rss0, (time.perf_counter() - t0) * 1000
            _M.stack.pop()
            _M.names.pop()
            _M.rows.append((module.__name__, int(rss - nested[0]), ms - nested[1], parent))
            if _M.stack:
                _M.stack[-1][0] += rss
                _M.stack[-1][1] += ms

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _TimedLoader(spec.loader)  # type: ignore[arg-type]
                return spec
        return None


def _write(path: str) -> None:
    document = {
        "rss_kib_at_exit": rss_kib(),
        "modules": [{"name": n, "kib": k, "ms": round(ms, 3), "by": by} for n, k, ms, by in _M.rows],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f)


def _replay(path: str) -> None:
    """Import the outermost modules of an earlier run, in its order."""
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)["modules"]
    for row in rows:
        if row["by"] == "" and row["name"] not in sys.modules and not row["name"].startswith("<"):
            try:
                importlib.import_module(row["name"])
            except Exception:  # an optional import that failed in the agent too
                continue


def main() -> None:
    out = os.environ.get("IMPORT_RSS", "")
    if not out:
        raise SystemExit("set IMPORT_RSS to the file the figures go to")
    _M.rows.append(("<python start-up>", rss_kib(), 0.0, ""))
    sys.meta_path.insert(0, _Finder())
    atexit.register(_write, out)
    if sys.argv[1:2] == ["--replay"]:
        _replay(sys.argv[2])
        return
    sys.argv[0] = "gpu-agent"
    runpy.run_module("agent", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
