"""Orphaned allocations: held devices whose pod or claim is gone, and CDI claim specs nobody prepared.

Pods are looked up on the fake API server over real HTTP (metadata only); claims come from the DRA
tests' fake claim source; the mechanisms are stand-ins that say who holds what.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from agent.cdi.names import ClaimSpecDirectory
from agent.core.config.current import ConfigState
from agent.core.config.loader import LoadedConfig, build_config
from agent.core.mechanism import Holder, Usage
from agent.kube.access import kubeconfig_access
from agent.kube.claims.model import PodRef
from agent.kube.client import KubeClient
from agent.kube.pods import KubePods, NoApiPods, PodLookup
from agent.observe.orphans import OrphanDetector, OrphanKind
from tests.dra_fakes import FakeClaimSource
from tests.fake_apiserver import FakeApiServer, serving, write_kubeconfig

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
    pods: PodLookup
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


@contextlib.asynccontextmanager
async def setup(tmp_path: Path, *, cdi_dir: Path | None = None, **orphans: object) -> AsyncIterator[Setup]:
    async with serving() as api, KubeClient(kubeconfig_access(write_kubeconfig(tmp_path, api.url))) as client:
        pods = KubePods(client)
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
        yield Setup(api, pods, plugin, dra, claims, events, registry, detector)


async def test_a_pod_the_api_server_no_longer_has_is_reported_on_the_second_check(tmp_path: Path) -> None:
    async with setup(tmp_path) as s:
        s.api.add_pod("ml", "train-0", uid="pod-uid-0")
        s.plugin.holders = {"GPU-0": (container("ml", "train-0"),), "GPU-1": (container("ml", "gone"),)}
        await s.detector.check()
        assert s.detector.orphans == []  # one answer is not enough: the kubelet may be a moment behind
        assert s.detector.pod_uid("ml", "train-0") == "pod-uid-0"
        with capture_logs() as logs:
            await s.detector.check()
            await s.detector.check()
        (orphan,) = s.detector.orphans
        assert (orphan.kind, orphan.namespace, orphan.name, orphan.gpus) == (OrphanKind.POD, "ml", "gone", ("GPU-1",))
        assert sum(1 for e in logs if e["event"] == "orphaned allocation") == 1
        assert s.events.sent == [("OrphanedAllocation", orphan.describe())]  # one Event per orphan
        assert "pod ml/gone still holds devices through the device plugin (GPU GPU-1)" in orphan.describe()
        assert s.metric("gpu_agent_orphans", kind="device-plugin-pod") == 1
        assert s.metric("gpu_agent_orphans_found_total", kind="device-plugin-pod") == 1
        state = s.detector.debug_state()
        assert state["count"] == 1 and state["orphans"][0]["action"] == "reported"  # type: ignore[index]
        # only pods the kubelet lists were asked about, as metadata
        asked = {r.path for r in s.api.requests if "/pods/" in r.path}
        assert asked == {"/api/v1/namespaces/ml/pods/train-0", "/api/v1/namespaces/ml/pods/gone"}
        # the kubelet lets go: resolved
        s.plugin.holders = {"GPU-0": (container("ml", "train-0"),)}
        with capture_logs() as logs:
            await s.detector.check()
        assert s.detector.orphans == [] and s.metric("gpu_agent_orphans", kind="device-plugin-pod") == 0
        assert any(e["event"] == "orphaned allocation resolved" for e in logs)
        assert s.detector.debug_state()["watched_subjects"] == 1  # nothing kept for what is no longer held


async def test_prepared_claims_whose_claim_or_pods_are_gone(tmp_path: Path) -> None:
    async with setup(tmp_path) as s:
        s.api.add_pod("ml", "alive", uid="u-alive")
        s.api.add_pod("ml", "renamed", uid="u-new")
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
        for _ in range(4):
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
        s.dra.holders = {"GPU-1": (claim("ml", "c", "uid-c"),)}
        s.claims.down = "the API server is down"
        s.api.fail(503, times=None, path="/pods/")
        for _ in range(4):
            await s.detector.check()
        assert s.detector.orphans == [] and s.detector.debug_state()["last_error"] in (
            "the API server is down",
            f"GET {s.api.url}/api/v1/namespaces/ml/pods/gone?resourceVersion=0: 503 ServiceUnavailable: "
            "the fake API server was told to answer 503",
        )
        # and an earlier "gone" answer is neither confirmed nor forgotten by unknown ones
        s.api.clear()
        await s.detector.check()
        s.api.fail(503, times=None, path="/pods/")
        for _ in range(3):
            await s.detector.check()
        assert s.detector.orphans == []
        s.api.clear()
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


async def test_lookups_per_check_are_bounded_and_reach_every_pod(tmp_path: Path) -> None:
    async with setup(tmp_path, max_lookups=5) as s:
        holders: Mapping[str, tuple[Holder, ...]] = {
            f"GPU-{i % 8}": tuple(container("ml", f"p{j}") for j in range(i * 4, i * 4 + 4)) for i in range(8)
        }
        s.plugin.holders = dict(holders)
        for check in range(1, 8):
            before = s.api.count("GET", "/pods/")
            await s.detector.check()
            assert s.api.count("GET", "/pods/") - before == 5, check
        assert s.detector.debug_state()["watched_subjects"] == 32  # every pod got its turn
        asked = {r.path.rsplit("/", 1)[1] for r in s.api.requests if "/pods/" in r.path}
        assert asked == {f"p{j}" for j in range(32)}


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
