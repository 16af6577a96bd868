"""List-then-watch against the fake API server over real HTTP: resumed streams, 410 and restarts,
backoff with jitter, freshness, and the hostile cases (too big, too many, too slow, never ending)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.base.backoff import Backoff
from agent.kube.access import kubeconfig_access
from agent.kube.client import KubeClient, Limits
from agent.kube.listwatch import WATCH_BACKOFF, ListWatch, WatchTiming
from agent.kube.pods import NodePods, PodState
from tests.fake_apiserver import NODE, FakeApiServer, serving, write_kubeconfig
from tests.fake_sleep import FakeSleep
from tests.test_plugin_fakes import wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    async with serving() as fake:
        yield fake


@contextlib.asynccontextmanager
async def client_for(api: FakeApiServer, tmp_path: Path, **limits: Any) -> AsyncIterator[KubeClient]:
    access = kubeconfig_access(write_kubeconfig(tmp_path, api.url))
    async with KubeClient(access, limits=Limits(**limits)) as client:
        yield client


class Collected:
    """A ListWatch over this node's pods with what it hands its owner."""

    def __init__(self, client: KubeClient, sleep: FakeSleep, clock: Clock, backoff: Backoff = WATCH_BACKOFF) -> None:
        self.lists: list[list[Any]] = []
        self.events: list[tuple[str, str]] = []
        self.errors: list[str] = []
        self.watch = ListWatch(
            client,
            path="/api/v1/pods",
            params={"fieldSelector": f"spec.nodeName={NODE}"},
            on_list=self.lists.append,
            on_event=lambda kind, obj: self.events.append((kind, obj["metadata"]["name"])),
            on_error=lambda exc: self.errors.append(str(exc)),
            timing=WatchTiming(backoff=backoff, sleep=sleep, clock=clock),
        )
        self.task = asyncio.create_task(self.watch.run())

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def _lists(api: FakeApiServer) -> list[dict[str, str]]:
    return [r.query for r in api.requests if r.path == "/api/v1/pods" and r.query.get("watch") != "true"]


async def test_one_list_then_streams_resumed_with_jittered_timeouts(api: FakeApiServer, tmp_path: Path) -> None:
    api.add_pod("ml", "a")
    api.add_pod("ml", "elsewhere", node="other-node")
    async with client_for(api, tmp_path) as client:
        sleep, clock = FakeSleep(), Clock()
        c = Collected(client, sleep, clock)
        try:
            first = await api.next_watch()
            assert _lists(api) == [{"fieldSelector": f"spec.nodeName={NODE}", "resourceVersion": "0"}]  # the cache
            assert [i["metadata"]["name"] for i in c.lists[0]] == ["a"]  # the selector is the server's
            assert first["allowWatchBookmarks"] == "true" and first["resourceVersion"] == str(api.rv)
            timeouts = {int(first["timeoutSeconds"])}
            for _ in range(6):
                api.add_pod("ml", f"p{len(timeouts)}-{api.rv}")
                await wait_for(lambda: c.watch.resource_version == str(api.rv), what="the event")
                seen = c.watch.resource_version
                api.end_watches()  # the server ends each stream at its timeout
                query = await api.next_watch()
                assert query["resourceVersion"] == seen  # resumed, not listed
                timeouts.add(int(query["timeoutSeconds"]))
            assert all(300 <= t < 600 for t in timeouts) and len(timeouts) > 1  # drawn per stream
            assert len(_lists(api)) == 1 and sleep.delays == [] and c.errors == []
            assert c.watch.fresh()
            clock.now += 149
            assert c.watch.fresh()
            clock.now += 2  # nothing heard for longer than three bookmarks would take
            assert not c.watch.fresh()
            api.bookmark("pods")
            await wait_for(c.watch.fresh, what="the bookmark")
            assert c.events[-1][0] == "ADDED"  # bookmarks advance the version and reach no owner
        finally:
            await c.stop()


async def test_an_api_server_restart_relists_once_after_a_jittered_backoff(api: FakeApiServer, tmp_path: Path) -> None:
    async with client_for(api, tmp_path) as client:
        sleep, clock = FakeSleep(), Clock()
        c = Collected(client, sleep, clock)
        try:
            await api.next_watch()
            seen = c.watch.resource_version
            api.restart()  # streams cut; the new watch cache starts after every version we hold
            await sleep.release()  # the broken stream: a backoff before the retry
            await api.next_watch()  # which the new server answers with 410
            await sleep.release()  # ... and a backoff before the list
            await api.next_watch()
            assert [q.get("resourceVersion") for q in _lists(api)] == ["0", seen]  # "not older than" what we had
            assert c.watch.expired == 1 and len(c.lists) == 2
            assert all(0.5 <= d <= 3.0 for d in sleep.delays), sleep.delays
            # a server that refuses even that list is asked for its latest (etcd)
            api.fail(410, times=1, path="/api/v1/pods", watch=False, message="too old resource version")
            api.expire_watches()
            await sleep.release()  # 410: a backoff, then a list that gets 410 too
            await sleep.release()  # another, then a list from etcd
            await api.next_watch()
            assert [q.get("resourceVersion") for q in _lists(api)][-2:] == [str(api.rv), None]
        finally:
            await c.stop()


def test_the_watch_backoff_spreads_a_fleet() -> None:
    """After a restart every node retries at once: the delays of 1,000 nodes are spread, not stacked."""
    for attempt in (1, 3, 6, 20):
        delays = [WATCH_BACKOFF.delay(attempt) for _ in range(1000)]
        base = min(30.0, 2.0 ** (attempt - 1))
        assert base * 0.5 <= min(delays) and max(delays) <= base * 1.5
        buckets = {int(d / base * 10) for d in delays}
        assert len(buckets) >= 9  # across the whole [½, 1½] range


async def test_failures_back_off_and_recover(api: FakeApiServer, tmp_path: Path) -> None:
    async with client_for(api, tmp_path) as client:
        sleep, clock = FakeSleep(), Clock()
        api.fail(503, times=3, path="/api/v1/pods", watch=False)
        c = Collected(client, sleep, clock, backoff=Backoff(initial_s=1.0, max_s=30.0, jitter=0.0))
        try:
            for _ in range(3):
                await sleep.release()
            await api.next_watch()
            assert sleep.delays == [1.0, 2.0, 4.0] and len(c.errors) == 3
            assert c.watch.last_error == "" and c.watch.fresh()
        finally:
            await c.stop()


async def test_a_list_too_big_is_refused_and_retried(api: FakeApiServer, tmp_path: Path) -> None:
    async with client_for(api, tmp_path, list_bytes=64 * 1024) as client:
        sleep, clock = FakeSleep(), Clock()
        api.oversize(10 * 1024 * 1024, times=1, path="/api/v1/pods")
        c = Collected(client, sleep, clock)
        try:
            await sleep.release()
            await api.next_watch()
            assert "over the limit of 65536 bytes" in c.errors[0]
            assert api.bytes_sent_oversize < 10 * 1024 * 1024  # stopped reading
        finally:
            await c.stop()


async def test_an_event_too_big_breaks_the_stream_which_resumes(api: FakeApiServer, tmp_path: Path) -> None:
    async with client_for(api, tmp_path, watch_line_bytes=32 * 1024) as client:
        sleep, clock = FakeSleep(), Clock()
        c = Collected(client, sleep, clock)
        try:
            await api.next_watch()
            seen = c.watch.resource_version
            api.push({"type": "ADDED", "object": {"metadata": {"name": "x" * 100_000}}}, resource="pods")
            await sleep.release()
            query = await api.next_watch()
            assert "event longer than 32768 bytes" in c.errors[0] and query["resourceVersion"] == seen
            assert c.events == []
        finally:
            await c.stop()


async def test_a_watch_that_never_answers_is_cut_and_retried(api: FakeApiServer, tmp_path: Path) -> None:
    async with client_for(api, tmp_path, watch_idle_s=0.2) as client:
        sleep, clock = FakeSleep(), Clock()
        api.hang(times=1, path="/api/v1/pods", watch=True)
        c = Collected(client, sleep, clock)
        try:
            await sleep.release()
            await api.next_watch()
            # the retry reached the server; the error clears once its answer's headers are read
            await wait_for(lambda: not c.watch.last_error, what="the retried watch to open")
            assert "timed out" in c.errors[0]
        finally:
            await c.stop()


async def test_a_slow_list_is_cut_by_the_request_limit(api: FakeApiServer, tmp_path: Path) -> None:
    async with client_for(api, tmp_path, request_timeout_s=0.2) as client:
        sleep, clock = FakeSleep(), Clock()
        api.delay_s = 1.0
        c = Collected(client, sleep, clock)
        try:
            await sleep.next()
            assert "no answer within 0.2s" in c.errors[0]
            assert not c.watch.synced.is_set() and not c.watch.fresh()
        finally:
            await c.stop()


async def test_too_many_pods_are_not_all_kept_and_none_is_called_gone(api: FakeApiServer, tmp_path: Path) -> None:
    for i in range(150):
        api.add_pod("ml", f"p{i}")
    async with client_for(api, tmp_path) as client:
        pods = NodePods(client, node_name=NODE, max_pods=100, timing=WatchTiming(sleep=FakeSleep()))
        task = asyncio.create_task(pods.run())
        try:
            await wait_for(pods.watch.fresh, what="the list")
            assert len(pods) == 100
            assert pods.state("ml", "p0").state is PodState.PRESENT
            unknown = pods.state("ml", "p149")
            assert unknown.state is PodState.UNKNOWN and "more than 100 pods" in unknown.reason
            api.add_pod("ml", "late")  # still full: not kept, still not gone
            await wait_for(lambda: pods.watch.resource_version == str(api.rv), what="the event")
            assert pods.state("ml", "late").state is PodState.UNKNOWN
            for i in range(60):
                api.delete_pod("ml", f"p{i}")
            await wait_for(lambda: pods.watch.resource_version == str(api.rv), what="the deletions")
            assert pods.state("ml", "p0").state is PodState.UNKNOWN  # the view stays incomplete until a list
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_pods_with_names_no_pod_can_have_are_ignored(api: FakeApiServer, tmp_path: Path) -> None:
    async with client_for(api, tmp_path) as client:
        pods = NodePods(client, node_name=NODE, timing=WatchTiming(sleep=FakeSleep()))
        task = asyncio.create_task(pods.run())
        try:
            await api.next_watch()
            bad = {"metadata": {"namespace": "ml", "name": "Bad Name"}}
            api.push({"type": "ADDED", "object": bad}, resource="pods")
            api.push({"type": "ADDED", "object": {"metadata": "garbage"}}, resource="pods")
            api.add_pod("ml", "fine")
            await wait_for(lambda: pods.state("ml", "fine").state is PodState.PRESENT, what="the good pod")
            assert len(pods) == 1
            assert pods.state("ml", "Bad Name").state is PodState.UNKNOWN
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_a_node_without_pods_is_a_known_empty_view(api: FakeApiServer, tmp_path: Path) -> None:
    """A real v1.36 API server sends an empty PartialObjectMetadataList's items as null (seen on one):
    that is a list with nothing in it, not an unusable answer."""
    async with client_for(api, tmp_path) as client:
        pods = NodePods(client, node_name=NODE, timing=WatchTiming(sleep=FakeSleep(), clock=Clock()))
        task = asyncio.create_task(pods.run())
        try:
            await api.next_watch()
            assert pods.state("ml", "gone").state is PodState.GONE
            assert not pods.watch.last_error
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
