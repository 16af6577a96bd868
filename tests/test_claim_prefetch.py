"""DRA's claim read-ahead: a pod arriving on the node has its claims read before the kubelet asks.

Unit tests drive :class:`ClaimPrefetch` with a scripted claim source (each GET is a future the
test resolves); the last tests run it behind the real pod watch and client against the fake API
server, and through the DRA driver, counting the GETs the server saw.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.kube.access import kubeconfig_access
from agent.kube.claims.model import ClaimRef, PodRef, ResourceClaim
from agent.kube.claims.prefetch import ClaimPrefetch
from agent.kube.claims.source import KubeClaimSource
from agent.kube.client import KubeClient
from agent.kube.errors import KubeError
from agent.kube.listwatch import WatchTiming
from agent.kube.pods import NodePods
from tests.fake_apiserver import NODE, FakeApiServer, serving, write_kubeconfig
from tests.fake_sleep import FakeSleep
from tests.test_plugin_fakes import wait_for

NS = "ml"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ScriptedClaims:
    """A claim source whose every GET waits for the test to answer it."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []
        self.pending: dict[tuple[str, str], list[asyncio.Future[ResourceClaim | None]]] = {}
        #: answered at once instead, when set for a name
        self.answers: dict[str, ResourceClaim | Exception | None] = {}

    async def get_claim(self, ref: ClaimRef) -> ResourceClaim | None:
        self.asked.append((ref.namespace, ref.name))
        if ref.name in self.answers:
            answer = self.answers[ref.name]
            if isinstance(answer, Exception):
                raise answer
            return answer
        future: asyncio.Future[ResourceClaim | None] = asyncio.get_running_loop().create_future()
        self.pending.setdefault((ref.namespace, ref.name), []).append(future)
        return await future

    def answer(self, name: str, claim: ResourceClaim | None) -> None:
        self.pending[(NS, name)].pop(0).set_result(claim)


def claim(name: str, *, uid: str = "", pod_uid: str = "pod-1", allocated: bool = True) -> ResourceClaim:
    reserved = (PodRef(name="p", uid=pod_uid),) if pod_uid else ()
    return ResourceClaim(namespace=NS, name=name, uid=uid or f"uid-{name}", allocated=allocated, reserved_for=reserved)


def pod(*claims: str, uid: str = "pod-1", phase: str = "Pending", name: str = "p") -> dict[str, Any]:
    return {
        "metadata": {"namespace": NS, "name": name, "uid": uid},
        "spec": {"resourceClaims": [{"name": f"r{i}", "resourceClaimName": c} for i, c in enumerate(claims)]},
        "status": {"phase": phase},
    }


def ref(name: str, uid: str = "") -> ClaimRef:
    return ClaimRef(NS, name, uid or f"uid-{name}")


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_claim_read_when_its_pod_arrived_is_the_one_prepare_gets() -> None:
    source = ScriptedClaims()
    prefetch = ClaimPrefetch(source)
    prefetch.pod_added(pod("a"))
    await settle()
    assert source.asked == [(NS, "a")]
    source.answer("a", claim("a"))
    got = await prefetch.get_claim(ref("a"))
    assert got == claim("a") and source.asked == [(NS, "a")]  # no second GET
    assert prefetch.used == 1
    # used once: the next prepare of the same name reads again
    source.answers["a"] = claim("a")
    assert await prefetch.get_claim(ref("a")) == claim("a")
    assert source.asked == [(NS, "a"), (NS, "a")]


async def test_prepare_waits_for_a_read_still_in_flight_instead_of_starting_another() -> None:
    source = ScriptedClaims()
    prefetch = ClaimPrefetch(source)
    prefetch.pod_added(pod("a"))
    waiting = asyncio.create_task(prefetch.get_claim(ref("a")))
    await settle()
    assert not waiting.done()
    source.answer("a", claim("a"))
    assert await waiting == claim("a")
    assert source.asked == [(NS, "a")]


@pytest.mark.parametrize(
    ("read", "why"),
    [
        (claim("a", uid="other"), "another UID: deleted and re-created since"),
        (claim("a", allocated=False), "not allocated"),
        (claim("a", pod_uid="pod-2"), "reserved for another pod"),
        (claim("a", pod_uid=""), "reserved for nobody"),
        (None, "did not exist"),
    ],
)
async def test_a_read_that_is_not_what_prepare_needs_is_read_again(read: ResourceClaim | None, why: str) -> None:
    source = ScriptedClaims()
    prefetch = ClaimPrefetch(source)
    prefetch.pod_added(pod("a"))
    await settle()
    source.answer("a", read)
    source.answers["a"] = claim("a")
    assert await prefetch.get_claim(ref("a")) == claim("a"), why
    assert source.asked == [(NS, "a"), (NS, "a")] and prefetch.not_used == 1


async def test_a_failed_read_is_made_again_and_its_error_is_the_new_ones() -> None:
    source = ScriptedClaims()
    prefetch = ClaimPrefetch(source)
    source.answers["a"] = KubeError("connection refused")
    prefetch.pod_added(pod("a"))
    await settle()
    source.answers["a"] = KubeError("API server overloaded")
    with pytest.raises(KubeError, match="overloaded"):
        await prefetch.get_claim(ref("a"))
    assert len(source.asked) == 2


async def test_a_read_older_than_its_limit_is_not_used() -> None:
    source, clock = ScriptedClaims(), Clock()
    prefetch = ClaimPrefetch(source, ttl_s=60.0, clock=clock)
    prefetch.pod_added(pod("a"))
    await settle()
    source.answer("a", claim("a"))
    clock.now += 61
    source.answers["a"] = claim("a", pod_uid="pod-1")
    await prefetch.get_claim(ref("a"))
    assert len(source.asked) == 2 and prefetch.used == 0


async def test_a_pod_that_left_takes_its_reads_with_it() -> None:
    source = ScriptedClaims()
    prefetch = ClaimPrefetch(source)
    prefetch.pod_added(pod("a", "b"))
    await settle()
    source.answer("a", claim("a"))
    prefetch.pod_deleted(pod("a", "b", phase="Succeeded"))  # b's read is cancelled in flight
    await settle()
    assert source.pending[(NS, "b")][0].cancelled()
    source.answers.update(a=claim("a"), b=claim("b"))
    await prefetch.get_claim(ref("a"))
    await prefetch.get_claim(ref("b"))
    assert source.asked == [(NS, "a"), (NS, "b"), (NS, "a"), (NS, "b")]
    assert prefetch.debug_state()["kept"] == 0 and prefetch.debug_state()["in_flight"] == 0


async def test_another_pod_naming_the_claim_reads_it_again_for_that_pod() -> None:
    """A claim handed from one pod to the next: the read for the first must not serve the second."""
    source = ScriptedClaims()
    prefetch = ClaimPrefetch(source)
    prefetch.pod_added(pod("a", uid="pod-1"))
    await settle()
    source.answer("a", claim("a", pod_uid="pod-1"))
    prefetch.pod_added(pod("a", uid="pod-2", name="q"))
    await settle()
    source.answer("a", claim("a", pod_uid="pod-2"))
    assert await prefetch.get_claim(ref("a")) == claim("a", pod_uid="pod-2")
    assert prefetch.used == 1 and len(source.asked) == 2


async def test_started_pods_and_claims_prepared_already_are_not_read() -> None:
    source = ScriptedClaims()
    prefetch = ClaimPrefetch(source)
    prefetch.skip_prepared(lambda namespace, name: name == "done")
    prefetch.pod_added(pod("a", phase="Running"))
    prefetch.pod_added(pod("a", phase="Succeeded"))
    prefetch.pod_added(pod("done", "b"))
    await settle()
    assert source.asked == [(NS, "b")]


@pytest.mark.parametrize(
    "garbage",
    [None, "pod", [], {"metadata": "x"}, {"metadata": {"namespace": NS, "name": "p", "uid": "u"}, "spec": []}],
)
async def test_objects_that_are_no_pod_are_ignored(garbage: Any) -> None:
    source = ScriptedClaims()
    prefetch = ClaimPrefetch(source)
    prefetch.pod_added(garbage)
    prefetch.pod_deleted(garbage)
    await settle()
    assert source.asked == []


async def test_reads_are_bounded_in_flight_and_in_number_kept() -> None:
    source = ScriptedClaims()
    prefetch = ClaimPrefetch(source, max_inflight=4, max_entries=6)
    prefetch.pod_added(pod(*(f"c{i}" for i in range(10))))
    await settle()
    assert len(source.asked) == 4 and prefetch.skipped == 6
    for i in range(4):
        source.answer(f"c{i}", claim(f"c{i}"))
    await settle()
    prefetch.pod_added(pod(*(f"d{i}" for i in range(4)), uid="pod-2", name="q"))
    await settle()
    state = prefetch.debug_state()
    assert state["kept"] == 6 and state["in_flight"] == 4  # c0 and c1 made room
    source.answers["c0"] = claim("c0")
    await prefetch.get_claim(ref("c0"))
    assert source.asked.count((NS, "c0")) == 2
    # a pod naming more claims than the API allows is cut at the bound
    many = ClaimPrefetch(ScriptedClaims(), max_inflight=1000, max_entries=1000)
    many.pod_added(pod(*(f"m{i}" for i in range(500)), uid="pod-3"))
    await settle()
    assert many.started == 64
    await many.close()
    await prefetch.close()


async def test_a_prepare_that_gives_up_cancels_its_read_and_nothing_leaks() -> None:
    source = ScriptedClaims()
    prefetch = ClaimPrefetch(source)
    prefetch.pod_added(pod("a"))
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await prefetch.get_claim(ref("a"))
    await settle()
    assert source.pending[(NS, "a")][0].cancelled()
    assert prefetch.debug_state() == {
        "kept": 0,
        "in_flight": 0,
        "started": 1,
        "used": 0,
        "not_used": 0,
        "skipped": 0,
    }


async def test_shutdown_cancels_reads_in_flight() -> None:
    source = ScriptedClaims()
    prefetch = ClaimPrefetch(source)
    runner = asyncio.create_task(prefetch.run())
    prefetch.pod_added(pod("a", "b"))
    await settle()
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)
    assert all(f.cancelled() for futures in source.pending.values() for f in futures)
    assert prefetch.debug_state()["in_flight"] == 0


# --- behind the real pod watch, against the fake API server -----------------------------------


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    async with serving() as fake:
        yield fake


def api_claim(name: str, pod_uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": NS, "name": name, "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpu", "driver": "gpu.example.com", "pool": NODE, "device": "gpu-0"}]
                }
            },
            "reservedFor": [{"resource": "pods", "name": "p", "uid": pod_uid}],
        },
    }


async def test_a_pod_bound_to_the_node_has_its_claim_read_once_before_prepare(
    api: FakeApiServer, tmp_path: Path
) -> None:
    async with KubeClient(kubeconfig_access(write_kubeconfig(tmp_path, api.url))) as client:
        prefetch = ClaimPrefetch(KubeClaimSource(client=client))
        pods = NodePods(client, node_name=NODE, timing=WatchTiming(sleep=FakeSleep()), arrivals=prefetch)
        task = asyncio.create_task(pods.run())
        try:
            await api.next_watch()
            api.put_claim(api_claim("p-gpu-x1", "uid-ml-p"))
            api.add_pod(NS, "p", phase="Pending", claims=("p-gpu-x1",))
            api.add_pod(NS, "running", claims=("other",))  # started already: never read ahead

            def claim_gets() -> int:
                return api.count("GET", "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/p-gpu-x1")

            await wait_for(lambda: claim_gets() == 1, what="the read ahead")
            got = await prefetch.get_claim(ref("p-gpu-x1"))
            assert got is not None and got.allocated and claim_gets() == 1
            assert api.count("GET", "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/other") == 0
            assert prefetch.used == 1
            assert pods.state(NS, "p").uid == "uid-ml-p"  # the pod view is what it was
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await prefetch.close()
