"""Orphaned allocations: held devices whose pod or claim is gone, and CDI claim specs nobody prepared.

Pods come from the watch of the node's pods on the fake API server over real HTTP (metadata only),
with single reads to confirm; claims come from the DRA tests' fake claim source; the mechanisms are
stand-ins that say who holds what. What is counted is what one agent would ask of the API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from agent.base.backoff import Backoff
from agent.cdi.names import ClaimSpecDirectory
from agent.core.config.current import ConfigState
from agent.core.config.loader import LoadedConfig, build_config
from agent.core.mechanism import Holder, Usage
from agent.kube.access import kubeconfig_access
from agent.kube.claims.model import PodRef
from agent.kube.client import KubeClient
from agent.kube.listwatch import WatchTiming
from agent.kube.pods import NoApiPods, NodePods
from agent.observe.orphans import OrphanDetector, OrphanKind
from tests.dra_fakes import FakeClaimSource
from tests.fake_apiserver import NODE, FakeApiServer, serving, write_kubeconfig
from tests.test_plugin_fakes import wait_for

KIND = "k8s.gpu-node-agent.nvidia.com/claim"
UID_X = "0b1c2d3e-0000-4000-8000-00000000000a"
UID_Y = "0b1c2d3e-0000-4000-8000-00000000000b"


@dataclass
class Holding:
    """A mechanism's usage, as the test sets it."""

    holders: dict[str, tuple[Holder, ...]] = field(default_factory=dict)
    known: bool = True

    def usage(self) -> Usage:
        return Usage(known=self.known, holders=dict(self.holders))


@dataclass
class Events:
    sent: list[tuple[str, str]] = field(default_factory=list)

    def normal(self, reason: str, message: str) -> None:
        self.sent.append((reason, message))

    def warning(self, reason: str, message: str) -> None:
        self.sent.append((reason, message))


def container(namespace: str, pod: str, name: str = "main") -> Holder:
    return Holder(kind="container", namespace=namespace, name=pod, detail=name)


def claim(namespace: str, name: str, uid: str) -> Holder:
    return Holder(kind="claim", namespace=namespace, name=name, uid=uid)


def config(**orphans: object) -> ConfigState:
    return ConfigState(LoadedConfig(config=build_config({"orphans": orphans}), version="t", source="test"))


@dataclass
class Setup:
    api: FakeApiServer
    pods: NodePods
    plugin: Holding
    dra: Holding
    claims: FakeClaimSource
    events: Events
    registry: CollectorRegistry
    detector: OrphanDetector

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels or None) or 0.0

    def kinds(self) -> list[tuple[OrphanKind, str]]:
        return sorted((o.kind, o.name or o.uid) for o in self.detector.orphans)

    def reads(self) -> int:
        """Requests other than the pod watch's list and stream: what a check costs the API server."""
        return sum(1 for r in self.api.requests if r.path != "/api/v1/pods") + len(self.claims.calls)

    async def settled(self) -> None:
        """Wait until the pod watch has applied everything the fake server has recorded."""
        await wait_for(
            lambda: self.pods.watch.fresh() and self.pods.watch.resource_version == str(self.api.rv),
            what="the pod watch to catch up",
        )


#: retries in these tests are quick: the loops under test are the detector's, not the backoff's
QUICK = WatchTiming(backoff=Backoff(initial_s=0.001, max_s=0.01))


@contextlib.asynccontextmanager
async def setup(tmp_path: Path, *, cdi_dir: Path | None = None, **orphans: object) -> AsyncIterator[Setup]:
    async with serving() as api, KubeClient(kubeconfig_access(write_kubeconfig(tmp_path, api.url))) as client:
        pods = NodePods(client, node_name=NODE, timing=QUICK)
        plugin, dra, claims, events, registry = (
            Holding(),
            Holding(),
            FakeClaimSource(),
            Events(),
            CollectorRegistry(),
        )
        detector = OrphanDetector(
            mechanisms={"device-plugin": plugin, "dra": dra},  # type: ignore[dict-item]
            pods=pods,
            claims=claims,
            config=config(**orphans),
            claim_specs=ClaimSpecDirectory(cdi_dir, KIND) if cdi_dir is not None else None,
            events=events,
            registry=registry,
        )
        watching = asyncio.create_task(pods.run())
        try:
            setup = Setup(api, pods, plugin, dra, claims, events, registry, detector)
            await setup.settled()
            yield setup
        finally:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)


async def test_a_pod_the_api_server_no_longer_has_is_reported_on_the_second_check(tmp_path: Path) -> None:
    async with setup(tmp_path) as s:
        s.api.add_pod("ml", "train-0", uid="pod-uid-0")
        s.api.add_pod("ml", "gone", uid="pod-uid-g")
        await s.settled()
        s.plugin.holders = {"GPU-0": (container("ml", "train-0"),), "GPU-1": (container("ml", "gone"),)}
        for _ in range(3):
            await s.detector.check()
        assert s.detector.orphans == [] and s.reads() == 0  # the watch answers: no request per check
        assert s.detector.pod_uid("ml", "train-0") == "pod-uid-0"
        s.api.delete_pod("ml", "gone")  # pushed to the agent by the watch
        await s.settled()
        await s.detector.check()
        assert s.detector.orphans == [] and s.reads() == 0  # one check is not enough: the kubelet may be behind
        with capture_logs() as logs:
            await s.detector.check()  # the second reads the pod once before calling it gone ...
            await s.detector.check()  # ... and later checks ask nothing more
        (orphan,) = s.detector.orphans
        assert (orphan.kind, orphan.namespace, orphan.name, orphan.gpus) == (OrphanKind.POD, "ml", "gone", ("GPU-1",))
        asked = [(r.path, r.query) for r in s.api.requests if r.path != "/api/v1/pods"]
        assert asked == [("/api/v1/namespaces/ml/pods/gone", {"resourceVersion": "0"})]  # from the cache
        assert sum(1 for e in logs if e["event"] == "orphaned allocation") == 1
        assert s.events.sent == [("OrphanedAllocation", orphan.describe())]  # one Event per orphan
        assert "pod ml/gone still holds devices through the device plugin (GPU GPU-1)" in orphan.describe()
        assert s.metric("gpu_agent_orphans", kind="device-plugin-pod") == 1
        assert s.metric("gpu_agent_orphans_found_total", kind="device-plugin-pod") == 1
        assert s.metric("gpu_agent_orphan_lookups_total", subject="pod", answer="gone") == 1
        state = s.detector.debug_state()
        assert state["count"] == 1 and state["orphans"][0]["action"] == "reported"  # type: ignore[index]
        # the kubelet lets go: resolved
        s.plugin.holders = {"GPU-0": (container("ml", "train-0"),)}
        with capture_logs() as logs:
            await s.detector.check()
        assert s.detector.orphans == [] and s.metric("gpu_agent_orphans", kind="device-plugin-pod") == 0
        assert any(e["event"] == "orphaned allocation resolved" for e in logs)
        assert s.detector.debug_state()["watched_subjects"] == 1  # nothing kept for what is no longer held


async def test_a_pod_the_watch_missed_is_read_and_the_watch_lists_again(tmp_path: Path) -> None:
    async with setup(tmp_path) as s:
        # a pod the watch never heard of (a missed event)
        meta = {"name": "hidden", "namespace": "ml", "uid": "u-hidden", "resourceVersion": str(s.api.rv)}
        s.api.pods[("ml", "hidden")] = {"kind": "Pod", "metadata": meta, "spec": {"nodeName": NODE}}
        lists = s.pods.watch.lists
        s.plugin.holders = {"GPU-0": (container("ml", "hidden"),)}
        await s.detector.check()
        await s.detector.check()  # missing twice: read, and it is there
        assert s.detector.orphans == [] and s.detector.pod_uid("ml", "hidden") == "u-hidden"
        s.api.bookmark("pods")  # the stream ends at its next event or bookmark and the view is listed again
        await wait_for(lambda: s.pods.watch.lists == lists + 1, what="the relist")
        assert s.pods.state("ml", "hidden").uid == "u-hidden"
        before = s.reads()
        await s.detector.check()
        await s.detector.check()
        assert s.detector.orphans == [] and s.reads() == before


async def test_prepared_claims_whose_claim_or_pods_are_gone(tmp_path: Path) -> None:
    async with setup(tmp_path) as s:
        s.api.add_pod("ml", "alive", uid="u-alive")
        s.api.add_pod("ml", "renamed", uid="u-new")
        await s.settled()
        live = s.claims.add("live", reserved_for=[PodRef("alive", "u-alive")], namespace="ml")
        deleted = s.claims.add("deleted", namespace="ml")
        del s.claims.claims[("ml", "deleted")]
        recreated = s.claims.add("recreated", namespace="ml", uid="uid-old")
        s.claims.add("recreated", namespace="ml", uid="uid-new")
        podless = s.claims.add("podless", reserved_for=[PodRef("gone", "u-gone")], namespace="ml")
        replaced = s.claims.add("replaced", reserved_for=[PodRef("renamed", "u-old")], namespace="ml")
        unreserved = s.claims.add("unreserved", namespace="ml")
        refs = [live, deleted, recreated, podless, replaced, unreserved]
        s.dra.holders = {f"GPU-{i}": (claim(r.namespace, r.name, r.uid),) for i, r in enumerate(refs)}
        for _ in range(3):
            await s.detector.check()
        assert s.kinds() == [
            (OrphanKind.CLAIM, n) for n in ("deleted", "podless", "recreated", "replaced", "unreserved")
        ]
        reasons = {o.name: o.reason for o in s.detector.orphans}
        assert reasons["deleted"].startswith("the ResourceClaim is gone from the API server")
        assert reasons["recreated"].startswith("the ResourceClaim was re-created (now UID uid-new)")
        assert reasons["podless"].startswith("every pod it is reserved for is gone (gone)")
        assert reasons["replaced"].startswith("every pod it is reserved for is gone (renamed)")
        assert reasons["unreserved"].startswith("no pod reserves the claim any more")
        assert s.metric("gpu_agent_orphans", kind="dra-claim") == 5
        assert len(s.events.sent) == 5
        assert s.detector.claim_pods("ml", "live", live.uid) == (("alive", "u-alive"),)  # for the holder series
        assert s.detector.claim_pods("ml", "deleted", deleted.uid) == ()
        # the live claim was read once, when first held; nothing is read again while nothing changes
        assert sum(1 for c in s.claims.calls if c == live) == 1
        before = s.reads()
        for _ in range(5):
            await s.detector.check()
        assert s.reads() == before


async def test_a_claim_whose_pod_ends_is_read_once_more_then_reported(tmp_path: Path) -> None:
    async with setup(tmp_path) as s:
        s.api.add_pod("ml", "trainer", uid="u-t")
        await s.settled()
        ref = s.claims.add("gpu", reserved_for=[PodRef("trainer", "u-t")], namespace="ml")
        s.dra.holders = {"GPU-0": (claim(ref.namespace, ref.name, ref.uid),)}
        await s.detector.check()
        assert s.claims.calls == [ref]  # read once when first held
        for _ in range(4):
            await s.detector.check()
        assert s.claims.calls == [ref] and s.reads() == 1 and s.detector.orphans == []
        # the pod ends, the controller takes it off reservedFor, the kubelet does not unprepare
        s.api.delete_pod("ml", "trainer")
        s.claims.add("gpu", namespace="ml", uid=ref.uid)
        await s.settled()
        await s.detector.check()
        assert s.reads() == 1  # one check that misses the pod asks nothing
        await s.detector.check()  # the second reads the pod and the claim once each, and reports
        (orphan,) = s.detector.orphans
        assert orphan.reason.startswith("no pod reserves the claim any more")
        assert s.reads() == 3 and s.claims.calls == [ref, ref]
        for _ in range(3):
            await s.detector.check()
        assert s.reads() == 3  # reported once, asked once


async def test_a_shared_claim_reserved_for_a_new_pod_is_no_orphan(tmp_path: Path) -> None:
    async with setup(tmp_path) as s:
        s.api.add_pod("ml", "first", uid="u-1")
        await s.settled()
        ref = s.claims.add("shared", reserved_for=[PodRef("first", "u-1")], namespace="ml")
        s.dra.holders = {"GPU-0": (claim(ref.namespace, ref.name, ref.uid),)}
        await s.detector.check()
        s.api.delete_pod("ml", "first")
        s.api.add_pod("ml", "second", uid="u-2")
        s.claims.add("shared", reserved_for=[PodRef("second", "u-2")], namespace="ml", uid=ref.uid)
        await s.settled()
        for _ in range(4):
            await s.detector.check()
        assert s.detector.orphans == [] and s.detector.claim_pods("ml", "shared", ref.uid) == (("second", "u-2"),)
        assert len(s.claims.calls) == 2  # first held, and once when its pod had gone


async def test_cdi_claim_specs_without_a_prepared_claim(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    stray, held = (
        cdi / f"k8s.gpu-node-agent.nvidia.com-claim_{UID_X}.json",
        cdi / f"k8s.gpu-node-agent.nvidia.com-claim_{UID_Y}.json",
    )
    for path in (stray, held, cdi / "k8s.gpu-node-agent.nvidia.com-gpu.json", cdi / "someone-else_x.json"):
        path.write_text("{}")
    async with setup(tmp_path, cdi_dir=cdi) as s:
        # a claim rebuilt from its spec has no name: it still counts as held
        s.dra.holders = {"GPU-0": (Holder(kind="claim", namespace="", name="", uid=UID_Y),)}
        await s.detector.check()
        assert s.detector.orphans == []
        await s.detector.check()
        (orphan,) = s.detector.orphans
        assert (orphan.kind, orphan.uid) == (OrphanKind.CDI_SPEC, UID_X)
        assert s.detector.debug_state()["orphans"][0]["action"] == "the CDI reconciler removes it"  # type: ignore[index]
        assert stray.exists()  # never deleted here: that is the reconciler's job
        stray.unlink()  # ... which it does
        await s.detector.check()
        assert s.detector.orphans == []


async def test_nothing_is_an_orphan_while_the_api_server_cannot_answer(tmp_path: Path) -> None:
    async with setup(tmp_path) as s:
        s.plugin.holders = {"GPU-0": (container("ml", "gone"),)}
        await s.detector.check()  # the watch says it is missing: once
        s.dra.holders = {"GPU-1": (claim("ml", "c", "uid-c"),)}
        s.claims.down = "the API server is down"
        s.api.fail(503, times=None, path="/pods")
        s.api.close_watches()
        await wait_for(lambda: not s.pods.watch.fresh(), what="the watch to fail")
        for _ in range(4):
            await s.detector.check()
        assert s.detector.orphans == [] and s.detector.debug_state()["last_error"]
        assert s.api.count("GET", "/pods/") == 0  # nothing read while the watch cannot answer
        assert len(s.claims.calls) == 1  # a failed claim read waits its backoff (an interval, doubling)
        # the earlier "missing" is neither confirmed nor forgotten by unknown answers
        s.api.clear()
        await s.settled()
        await s.detector.check()
        assert s.kinds() == [(OrphanKind.POD, "gone")]


async def test_without_api_access_or_usage_nothing_is_looked_up(tmp_path: Path) -> None:
    plugin = Holding({"GPU-0": (container("ml", "gone"),)})
    detector = OrphanDetector(
        mechanisms={"device-plugin": plugin},  # type: ignore[dict-item]
        pods=NoApiPods(),
        claims=FakeClaimSource(),
        config=config(),
    )
    for _ in range(3):
        await detector.check()
    assert detector.orphans == [] and detector.debug_state()["last_error"] == "no Kubernetes API access"
    plugin.known = False  # PodResources cannot answer: who holds what is unknown, so nothing is asked
    lookups = detector.lookups
    await detector.check()
    assert detector.lookups == lookups


async def test_reads_per_check_are_bounded_and_reach_every_pod(tmp_path: Path) -> None:
    async with setup(tmp_path, max_lookups=5) as s:
        for j in range(32):
            s.api.add_pod("ml", f"p{j}")
        holders: Mapping[str, tuple[Holder, ...]] = {
            f"GPU-{i % 8}": tuple(container("ml", f"p{j}") for j in range(i * 4, i * 4 + 4)) for i in range(8)
        }
        s.plugin.holders = dict(holders)
        await s.settled()
        await s.detector.check()
        assert s.reads() == 0  # the watch knows all 32
        for j in range(32):  # a namespace goes away; the kubelet is stuck
            s.api.delete_pod("ml", f"p{j}")
        await s.settled()
        await s.detector.check()
        for check in range(1, 8):
            before = s.api.count("GET", "/pods/")
            await s.detector.check()
            assert s.api.count("GET", "/pods/") - before == min(5, 32 - 5 * (check - 1)), check
        asked = [r.path.rsplit("/", 1)[1] for r in s.api.requests if "/pods/" in r.path]
        assert sorted(asked) == sorted(f"p{j}" for j in range(32))  # each once
        assert len(s.detector.orphans) == 32


async def test_while_the_watch_cannot_answer_nothing_is_read_or_called_gone(tmp_path: Path) -> None:
    async with setup(tmp_path) as s:
        s.api.add_pod("ml", "p")
        await s.settled()
        s.plugin.holders = {"GPU-0": (container("ml", "p"),), "GPU-1": (container("ml", "never-seen"),)}
        s.api.fail(503, times=None, path="/api/v1/pods")
        s.api.restart()  # the stream breaks, and the server keeps failing
        await wait_for(lambda: not s.pods.watch.fresh(), what="the watch to fail")
        for _ in range(4):
            await s.detector.check()
        assert s.detector.orphans == [] and s.api.count("GET", "/pods/") == 0
        assert s.detector.debug_state()["last_error"] == s.pods.watch.last_error
        assert s.detector.pod_uid("ml", "p") == "uid-ml-p"  # what was seen stays


async def test_a_silent_stream_from_a_server_that_sends_bookmarks_is_dropped(tmp_path: Path) -> None:
    """A dead connection says nothing; a live one carries a bookmark about every minute."""
    async with serving() as api, KubeClient(kubeconfig_access(write_kubeconfig(tmp_path, api.url))) as client:
        pods = NodePods(client, node_name=NODE, timing=dataclasses.replace(QUICK, fresh_s=0.2))
        with capture_logs() as logs:
            watching = asyncio.create_task(pods.run())
            try:
                await api.next_watch()
                api.bookmark("pods")  # this server sends bookmarks ...
                query = await api.next_watch()  # ... then nothing: the stream is dropped and resumed
                assert query["resourceVersion"] == str(api.rv) and pods.watch.lists == 1
            finally:
                watching.cancel()
                await asyncio.gather(watching, return_exceptions=True)
        (warning,) = [e for e in logs if e["log_level"] == "warning"]
        assert warning["error"] == "watch /api/v1/pods: nothing for 0.2s from a server that sends bookmarks"


async def test_names_the_api_could_not_hold_are_not_looked_up(tmp_path: Path) -> None:
    async with setup(tmp_path) as s:
        s.plugin.holders = {"GPU-0": (container("ml", 'Bad "Name"\n'),), "GPU-1": (container("x" * 300, "p"),)}
        for _ in range(3):
            await s.detector.check()
        assert s.detector.orphans == [] and s.api.count("GET", "/pods/") == 0
        assert "not a pod name" in str(s.detector.debug_state()["last_error"])


@pytest.mark.parametrize("enabled", [True, False])
def test_the_orphan_gauge_exists_for_every_kind(enabled: bool) -> None:
    registry = CollectorRegistry()
    OrphanDetector(
        mechanisms={}, pods=NoApiPods(), claims=FakeClaimSource(), config=config(enabled=enabled), registry=registry
    )
    for kind in OrphanKind:
        assert registry.get_sample_value("gpu_agent_orphans", {"kind": kind.value}) == 0


async def test_a_claim_read_that_keeps_failing_backs_off() -> None:
    """RBAC without get on resourceclaims must not turn into a read of every held claim every check."""
    now = [0.0]
    claims = FakeClaimSource()
    claims.down = 'resourceclaims "c" is forbidden'
    dra = Holding({f"GPU-{i}": (claim("ml", f"c{i}", f"uid-{i}"),) for i in range(8)})
    detector = OrphanDetector(
        mechanisms={"dra": dra},  # type: ignore[dict-item]
        pods=NoApiPods(),
        claims=claims,
        config=config(interval_s=30),
        clock=lambda: now[0],
    )
    reads_at: list[float] = []
    for _ in range(40):  # 20 minutes of checks
        before = len(claims.calls)
        await detector.check()
        if len(claims.calls) > before:
            reads_at.append(now[0])
            assert len(claims.calls) - before == 8
        now[0] += 30
    assert reads_at == [0, 30, 90, 210, 450, 930]  # an interval, doubling (to ten minutes at most)
    assert detector.orphans == [] and "forbidden" in detector.last_error
