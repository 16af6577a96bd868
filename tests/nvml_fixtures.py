"""Shared helpers for the NVML backend tests: temporary sysfs/procfs/driver roots, a watch harness."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from agent.backends.nvml.backend import NvmlBackend
from agent.core.config.schema import HealthConfig
from agent.core.health.model import Signal, SignalKind
from agent.core.inventory.model import Inventory
from tests.fakes.fake_pynvml import FakeNvml, write_sysfs

# periodic checks fast; or effectively only the first one, so events tests see no churn
CHECKS = HealthConfig(check_interval_s=0.02, event_wait_ms=20)
EVENTS = HealthConfig(check_interval_s=3600, event_wait_ms=20)
TIMEOUT = 5.0

Sink = Callable[[Signal], None]


def mig_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    base = 3 + gpu_minor * 15 * 9 + gi * 9
    return base if ci is None else base + 1 + ci


def roots(tmp_path: Path, fake: FakeNvml, *, sysfs: bool = True, mig_minors: bool = True) -> dict[str, Path]:
    """sysfs_root, procfs_root and an empty driver_root for ``fake`` under ``tmp_path``."""
    sys_root, proc_root, driver_root = tmp_path / "sys", tmp_path / "proc", tmp_path / "driver-root"
    sys_root.mkdir()
    driver_root.mkdir()
    if sysfs:
        write_sysfs(sys_root, fake.gpus)
    if mig_minors:
        lines = ["config 1", "monitor 2"]
        for minor in range(4):
            for gi in range(15):
                lines.append(f"gpu{minor}/gi{gi}/access {mig_minor(minor, gi)}")
                lines.extend(f"gpu{minor}/gi{gi}/ci{ci}/access {mig_minor(minor, gi, ci)}" for ci in range(8))
        path = proc_root / "driver" / "nvidia-caps" / "mig-minors"
        path.parent.mkdir(parents=True)
        path.write_text("\n".join(lines) + "\n")
    return {"sysfs_root": sys_root, "procfs_root": proc_root, "driver_root": driver_root}


def backend(
    fake: FakeNvml,
    tmp_path: Path,
    health: HealthConfig = CHECKS,
    *,
    sysfs: bool = True,
    mig_minors: bool = True,
    **kwargs: object,
) -> NvmlBackend:
    paths = roots(tmp_path, fake, sysfs=sysfs, mig_minors=mig_minors)
    return NvmlBackend(health=health, nvml=fake, **paths, **kwargs)  # type: ignore[arg-type]


async def opened(fake: FakeNvml, tmp_path: Path, health: HealthConfig = CHECKS, **kwargs: object) -> NvmlBackend:
    b = backend(fake, tmp_path, health, **kwargs)  # type: ignore[arg-type]
    await b.open()
    return b


@contextlib.asynccontextmanager
async def watching(
    b: NvmlBackend, inventory: Inventory, also: Sink | None = None, *, close: bool = True
) -> AsyncIterator[asyncio.Queue[Signal]]:
    """Runs ``watch_health`` as a task; yields the queue of its signals; cancels (and closes) after."""
    signals: asyncio.Queue[Signal] = asyncio.Queue()

    def sink(signal: Signal) -> None:
        if also is not None:
            also(signal)
        signals.put_nowait(signal)

    task = asyncio.create_task(b.watch_health(inventory, sink))
    try:
        yield signals
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, TIMEOUT)
        if close:
            await b.close()


async def next_signal(signals: asyncio.Queue[Signal], match: Callable[[Signal], bool]) -> Signal:
    async def find() -> Signal:
        while not match(signal := await signals.get()):
            pass
        return signal

    return await asyncio.wait_for(find(), TIMEOUT)


def not_ok(signal: Signal) -> bool:
    return signal.kind is not SignalKind.CHECK_OK


async def waits(fake: FakeNvml, count: int = 1) -> None:
    """Until the event thread has entered its wait ``count`` times in all (it registered first)."""
    assert await asyncio.to_thread(fake.wait_for_waits, count, TIMEOUT)


async def until(condition: Callable[[], bool]) -> None:
    """Until ``condition()`` holds (state in other threads and objects: polled), or TIMEOUT."""
    async with asyncio.timeout(TIMEOUT):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


def single_line(exc: BaseException | str) -> str:
    message = str(exc)
    assert message and "\n" not in message and "Traceback" not in message
    return message


def stand_in_library() -> Path:
    """A real ELF shared object that CDLL accepts and that is harmless to load from a copy:
    a Python extension module this process has loaded already (dlopen only maps it; its init
    function is never called). Stands in for libnvidia-ml.so.1 in a driver root."""
    import _ctypes

    path = Path(getattr(_ctypes, "__file__", "") or "")
    if path.is_file():
        return path
    for line in Path("/proc/self/maps").read_text().splitlines():
        candidate = Path(line.split()[-1])
        if "cpython" in candidate.name and candidate.suffix == ".so" and candidate.is_file():
            return candidate
    raise AssertionError("no Python extension module to stand in for a shared library")
