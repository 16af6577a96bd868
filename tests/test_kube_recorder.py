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


def _writes(api: FakeApiServer) -> list[tuple[str, int]]:
    """(method, count written) of every Event write."""
    return [(r.method, r.body["count"]) for r in api.requests if "/events" in r.path and r.method in ("POST", "PATCH")]


async def test_repeats_are_counted_in_one_object(api: FakeApiServer, tmp_path: Path) -> None:
    """A storm is one object with its count: created, "x2" at once, the rest once it is over."""
    clock = Clock()
    async with recording(api, tmp_path, clock=clock) as recorder:
        recorder.normal("Handover", "GPU-1 moved to dra")
        await until(lambda: len(api.events) == 1, "created")
        for _ in range(100):
            recorder.normal("Handover", "GPU-1 moved to dra")
        await until(lambda: recorder.debug_state()["queued"] == 0 and len(_writes(api)) == 2, "drained")
        (event,) = _events(api)
        assert event["count"] == 2  # the series began: written at once
        assert _writes(api) == [("POST", 1), ("PATCH", 2)]
        clock.now += 359
        recorder.normal("Other", "something else")  # wakes the drain task
        await until(lambda: len(api.events) == 2, "the other one")
        assert _writes(api)[-1] == ("POST", 1)  # still going: the count waits
        clock.now += 360  # quiet for finish_s: the final count
        recorder.normal("Other", "something else")
        await until(lambda: ("PATCH", 101) in _writes(api), "the final count")
        handover = [e for e in _events(api) if e["reason"] == "Handover"]
        assert len(handover) == 1 and handover[0]["count"] == 101
        assert handover[0]["firstTimestamp"] <= handover[0]["lastTimestamp"]
    assert api.count("PATCH") == 3 and api.count("POST") == 2  # Handover x3, Other x2 (created, x2)
    assert recorder.outcomes["created"] == 2 and recorder.outcomes["repeated"] == 3


async def test_a_condition_that_lasts_a_day_is_one_object_and_few_writes(api: FakeApiServer, tmp_path: Path) -> None:
    clock = Clock()
    async with recording(api, tmp_path, clock=clock) as recorder:
        for block in range(48):  # every 30 s for a day, in blocks of half an hour
            clock.now += 1800
            for _ in range(60):
                recorder.warning("AdvertisementDiverged", "nvidia.com/gpu kubelet-allocatable: 7, we list 8")
            await until(lambda: recorder.debug_state()["queued"] == 0, f"block {block}")
            await until(lambda: recorder.debug_state()["unwritten"] < 60, f"block {block} written")
        (event,) = _events(api)
        assert event["count"] > 47 * 60
    assert len(_writes(api)) <= 50  # one create, "x2", then one write per half hour


async def test_an_object_the_server_dropped_is_created_again_with_the_count(api: FakeApiServer, tmp_path: Path) -> None:
    clock = Clock()
    async with recording(api, tmp_path, clock=clock) as recorder:
        recorder.warning("OrphanedAllocation", "pod ml/x")
        await until(lambda: len(api.events) == 1, "created")
        api.events.clear()  # an hour later the API server has forgotten it
        recorder.warning("OrphanedAllocation", "pod ml/x")
        await until(lambda: len(api.events) == 1, "created again")
        (event,) = _events(api)
        assert event["count"] == 2 and event["reason"] == "OrphanedAllocation"
    assert [m for m, _ in _writes(api)] == ["POST", "PATCH", "POST"]


async def test_many_messages_for_one_reason_are_combined(api: FakeApiServer, tmp_path: Path) -> None:
    async with recording(api, tmp_path) as recorder:
        for i in range(12):
            recorder.warning("OrphanedAllocation", f"pod ml/p{i} still holds GPU {i}")
        await until(lambda: recorder.debug_state()["queued"] == 0 and api.count("PATCH") == 1, "written")
        assert recorder.debug_state()["unwritten"] == 1  # the twelfth waits for the series to end
    messages = sorted(e["message"] for e in api.events.values())
    combined = [m for m in messages if m.startswith("(combined from similar events): ")]
    assert len(messages) == 10 and len(combined) == 1  # nine of their own; from the tenth on, one combined
    (event,) = [e for e in api.events.values() if e["message"] in combined]
    # the tenth created it, the eleventh is its "x2" (with the newest message)
    assert event["count"] == 2 and event["message"].endswith("pod ml/p10 still holds GPU 10")


async def test_writes_are_budgeted_new_series_first(api: FakeApiServer, tmp_path: Path) -> None:
    clock = Clock()
    async with recording(api, tmp_path, clock=clock, burst=3, refill_s=100.0) as recorder:
        for i in range(5):
            recorder.warning(f"Reason{i}", "m")
        await until(lambda: recorder.debug_state()["queued"] == 0 and len(api.events) == 3, "the burst")
        recorder.warning("Reason0", "m")  # a repeat: waits behind the two new ones
        await until(lambda: recorder.debug_state()["queued"] == 0, "drained")
        assert len(api.events) == 3 and recorder.debug_state()["unwritten"] == 3
        clock.now += 100
        recorder.warning("Reason0", "m")  # wakes it: one token, for a new series
        await until(lambda: len(api.events) == 4, "one more")
        assert api.count("PATCH") == 0
        clock.now += 200
        recorder.warning("Reason0", "m")
        await until(lambda: len(api.events) == 5 and api.count("PATCH") == 1, "the last new one, then the count")
        assert {e["reason"]: e["count"] for e in api.events.values()}["Reason0"] == 4


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
    assert len(warnings) == 1 and "create and patch on events" in warnings[0]["event"]
    assert recorder.last_error == ""


async def test_cancel_arriving_with_an_event_still_stops_the_drain_task(api: FakeApiServer, tmp_path: Path) -> None:
    """On 3.11 ``wait_for`` could swallow a cancellation that arrived as the queue answered, and
    the agent's shutdown then waited for this task until its hard deadline."""
    async with KubeClient(kubeconfig_access(write_kubeconfig(tmp_path, api.url))) as client:
        recorder = EventRecorder(client=client, node_name=NODE, finish_s=3600.0)
        task = asyncio.create_task(recorder.run())
        recorder.normal("R", "m")
        recorder.normal("R", "m")  # a repeat waits for its interval: the task now waits with a timeout
        await until(lambda: len(api.events) == 1 and recorder.debug_state()["queued"] == 0, "created")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for i in range(50):
            task = asyncio.create_task(recorder.run())
            await asyncio.sleep(0)  # the task now waits on the queue, with a timeout
            recorder.normal("R", f"m{i}")  # wakes it ...
            task.cancel()  # ... in the same loop step as the cancellation
            with pytest.raises(asyncio.CancelledError):
                async with asyncio.timeout(TIMEOUT):
                    await task


async def test_what_is_remembered_is_bounded(api: FakeApiServer, tmp_path: Path) -> None:
    """A flood of distinct events keeps at most max_series series; the budget still holds."""
    async with recording(api, tmp_path, max_series=50, queue_size=1000) as recorder:
        for i in range(600):
            recorder.warning(f"Reason{i % 300}", f"message {i}")
        await until(lambda: recorder.debug_state()["queued"] == 0 and len(api.events) == 25, "the burst")
        state = recorder.debug_state()
        assert state["series"] == 50 and state["unwritten"] <= 50
    assert len(api.events) == 25  # 25 tokens: the rest waits for the refill, a new one every 5 minutes
