"""Node events through the real client into the fake API server: aggregation, bounds, failures."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from agent.kube.access import kubeconfig_access
from agent.kube.client import KubeClient
from agent.kube.recorder import EventRecorder
from tests.fake_apiserver import NODE, TIMEOUT, FakeApiServer, serving, write_kubeconfig


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def until(condition: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not condition():  # noqa: ASYNC110 - the state is the fake server's
            await asyncio.sleep(0.005)
    assert condition(), what


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    async with serving() as fake:
        yield fake


@contextlib.asynccontextmanager
async def recording(api: FakeApiServer, tmp_path: Path, **kwargs: Any) -> AsyncIterator[EventRecorder]:
    async with KubeClient(kubeconfig_access(write_kubeconfig(tmp_path, api.url))) as client:
        recorder = EventRecorder(client=client, node_name=NODE, **kwargs)
        task = asyncio.create_task(recorder.run())
        try:
            yield recorder
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _events(api: FakeApiServer) -> list[dict[str, Any]]:
    return sorted(api.events.values(), key=lambda e: e["metadata"]["name"])


async def test_an_event_names_the_node_and_is_cut_to_1_kib(api: FakeApiServer, tmp_path: Path) -> None:
    registry = CollectorRegistry()
    async with recording(api, tmp_path, registry=registry) as recorder:
        recorder.warning("GpuUnhealthy", "é" * 2000)
        await until(lambda: len(api.events) == 1, "created")
    (event,) = _events(api)
    assert event["metadata"]["namespace"] == "default" and event["metadata"]["name"].startswith(f"{NODE}.")
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE}
    assert event["type"] == "Warning" and event["reason"] == "GpuUnhealthy" and event["count"] == 1
    assert event["source"] == {"component": "gpu-node-agent", "host": NODE}
    assert len(event["message"].encode()) <= 1024 and event["message"].endswith("...")
    assert registry.get_sample_value("gpu_agent_kube_events_total", {"outcome": "created"}) == 1


async def test_repeats_are_aggregated_into_few_creates(api: FakeApiServer, tmp_path: Path) -> None:
    """Only create is granted on events: a storm becomes a few objects, the newest with the count."""
    clock = Clock()
    async with recording(api, tmp_path, clock=clock, repeat_interval_s=60.0, window_s=600.0) as recorder:
        recorder.normal("Handover", "GPU-1 moved to dra")
        await until(lambda: len(api.events) == 1, "created")
        for _ in range(100):
            recorder.normal("Handover", "GPU-1 moved to dra")
        await until(lambda: recorder.debug_state()["queued"] == 0, "drained")
        assert len(api.events) == 1  # within the repeat interval: counted, not yet written
        clock.now += 60
        recorder.normal("Other", "something else")  # wakes the drain task
        await until(lambda: len(api.events) == 3, "one repeat object")
        handover = [e for e in _events(api) if e["reason"] == "Handover"]
        assert sorted(e["count"] for e in handover) == [1, 101]
        assert len({e["firstTimestamp"] for e in handover}) == 1  # one series
        clock.now += 600  # past the window: the same event starts a new series
        recorder.normal("Handover", "GPU-1 moved to dra")
        await until(lambda: len(api.events) == 4, "a new series")
    assert recorder.outcomes["created"] == 3 and recorder.outcomes["repeated"] == 1
    assert api.count("PATCH") == 0


async def test_a_full_queue_drops_and_counts_without_blocking(api: FakeApiServer, tmp_path: Path) -> None:
    async with KubeClient(kubeconfig_access(write_kubeconfig(tmp_path, api.url))) as client:
        recorder = EventRecorder(client=client, node_name=NODE, queue_size=2)
        for i in range(5):
            recorder.normal("R", f"m{i}")  # no drain task runs: the queue fills
        assert recorder.outcomes["dropped"] == 3 and recorder.debug_state()["queued"] == 2


async def test_api_failures_are_counted_and_logged_once(api: FakeApiServer, tmp_path: Path) -> None:
    api.fail(403, times=None, message='events is forbidden: User "system:serviceaccount:x" cannot create')
    with capture_logs() as logs:
        async with recording(api, tmp_path) as recorder:
            for i in range(3):
                recorder.warning("R", f"m{i}")
            await until(lambda: recorder.outcomes["failed"] == 3, "three failures")
            api.clear()
            recorder.warning("R", "works")
            await until(lambda: len(api.events) == 1, "created")
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and "create on events" in warnings[0]["event"]
    assert recorder.last_error == ""


async def test_a_stop_that_meets_a_new_event_still_stops_the_recorder(api: FakeApiServer, tmp_path: Path) -> None:
    """On 3.11 a wait_for around the queue returned the event and swallowed the cancellation that
    came in the same loop step: the recorder ran on and the agent never finished stopping."""
    async with KubeClient(kubeconfig_access(write_kubeconfig(tmp_path, api.url))) as client:
        recorder = EventRecorder(client=client, node_name=NODE, repeat_interval_s=60)
        task = asyncio.create_task(recorder.run())
        recorder.warning("Repeated", "the same thing again")
        await until(lambda: recorder.outcomes["created"] == 1, "the first event")
        recorder.warning("Repeated", "the same thing again")  # counted: a repeat is due in 60 s
        await until(lambda: recorder.debug_state()["queued"] == 0, "the repeat counted")
        for _ in range(3):
            await asyncio.sleep(0)  # the recorder waits for the next event or the repeat
        recorder.warning("Another", "event")  # arrives in the same loop step as the stop
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=TIMEOUT)
        assert done, "the recorder swallowed its cancellation"
