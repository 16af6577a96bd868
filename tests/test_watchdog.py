"""The registration watchdog: a lasting disagreement between what the agent advertises and what the
node shows is repaired through the mechanism's own path, logged once, counted, and shown on /readyz.

The decisions run on a fake clock; the repairs run for real: the device plugin against the rude
fake kubelet (grpcio) and a fake PodResources server, the Node's status from the fake API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from agent.core.config.current import ConfigState
from agent.core.config.loader import LoadedConfig, build_config
from agent.core.mechanism import NodeStatus, RegistrationCheck
from agent.deviceplugin.podresources import PodResourcesClient, PodResourcesWatcher
from agent.deviceplugin.registration import Action, Observation, Step, decide
from agent.kube.access import kubeconfig_access
from agent.kube.client import KubeClient
from agent.kube.labels import NodeLabelSource
from agent.kube.nodestatus import NoApiNodeStatus, allocatable_of
from agent.observe.watchdog import Watchdog
from tests.dra_fakes import dra_harness
from tests.fake_apiserver import NODE, serving, write_kubeconfig
from tests.fake_podresources import FakePodResources
from tests.test_plugin_fakes import PluginHarness, plugin_harness, wait_for

GPU = "nvidia.com/gpu"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def config(**watchdog: Any) -> ConfigState:
    document = {"watchdog": {"grace_s": 30, "max_repairs": 3, **watchdog}}
    return ConfigState(LoadedConfig(config=build_config(document), version="t", source="test"))


@dataclass
class Events:
    sent: list[tuple[str, str, str]] = field(default_factory=list)

    def normal(self, reason: str, message: str) -> None:
        self.sent.append(("Normal", reason, message))

    def warning(self, reason: str, message: str) -> None:
        self.sent.append(("Warning", reason, message))


@dataclass
class Checked:
    """A mechanism that only answers registration checks: ``seen`` devices against 8 advertised."""

    seen: int | None = 8
    repairs: list[str] = field(default_factory=list)

    def registration_checks(self, node: NodeStatus) -> Sequence[RegistrationCheck]:
        return [
            RegistrationCheck(
                key=f"{GPU} kubelet-allocatable",
                advertised=8,
                seen=self.seen,
                agrees=self.seen == 8,
                detail=f"the kubelet counts {self.seen}, we list 8",
                repair=self.repairs.append,
            )
        ]


def watchdog(mechanism: Any, clock: Clock, events: Events, registry: CollectorRegistry | None = None) -> Watchdog:
    return Watchdog(
        mechanisms={"device-plugin": mechanism},
        node=NoApiNodeStatus(),
        config=config(),
        events=events,
        registry=registry,
        clock=clock,
    )


# --- decisions ---------------------------------------------------------------------------------


def test_a_short_disagreement_is_the_kubelet_catching_up() -> None:
    clock, events, m = Clock(), Events(), Checked(seen=0)
    dog = watchdog(m, clock, events)
    dog.evaluate()
    clock.now += 29.9
    dog.evaluate()
    m.seen = 8  # caught up within the grace period
    clock.now += 1
    dog.evaluate()
    assert m.repairs == [] and events.sent == [] and dog.readiness().ok and dog.readiness().detail == ""


def test_a_lasting_disagreement_is_repaired_logged_once_and_noted_then_resolved() -> None:
    clock, events, m = Clock(), Events(), Checked(seen=0)
    registry = CollectorRegistry()
    dog = watchdog(m, clock, events, registry)
    with capture_logs() as logs:
        dog.evaluate()
        clock.now += 30
        dog.evaluate()
        assert m.repairs == ["the kubelet counts 0, we list 8"]
        readiness = dog.readiness()
        assert readiness.ok and readiness.detail.startswith(f"repairing device-plugin {GPU} kubelet-allocatable")
        clock.now += 29  # the next repair waits one more grace period
        dog.evaluate()
        assert len(m.repairs) == 1
        clock.now += 1
        dog.evaluate()
        assert len(m.repairs) == 2
        m.seen = 8
        dog.evaluate()
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and warnings[0]["detail"] == "the kubelet counts 0, we list 8"
    assert any(e["event"] == "the node agrees with the agent again" and e["repairs"] == 2 for e in logs)
    assert [(t, r) for t, r, _ in events.sent] == [
        ("Warning", "AdvertisementDiverged"),
        ("Normal", "AdvertisementRepaired"),
    ]
    assert dog.readiness().ok and dog.debug_state()["disagreements"] == []
    labels = {"mechanism": "device-plugin", "check": f"{GPU} kubelet-allocatable"}
    assert registry.get_sample_value("gpu_agent_watchdog_repairs_total", labels) == 2


def test_repairs_that_keep_failing_make_the_agent_not_ready_and_back_off() -> None:
    clock, events, m = Clock(), Events(), Checked(seen=8 - 8)
    dog = watchdog(m, clock, events)
    dog.evaluate()
    times = []
    for _ in range(400):
        clock.now += 1
        before = len(m.repairs)
        dog.evaluate()
        if len(m.repairs) > before:
            times.append(clock.now - 100)
    assert times[:4] == [30, 60, 120, 210]  # grace, then grace x repairs so far
    readiness = dog.readiness()
    assert not readiness.ok
    assert readiness.detail.startswith(f"device-plugin {GPU} kubelet-allocatable still disagrees after")
    assert dog.debug_state()["disagreements"][0]["state"] == "failing"  # type: ignore[index]


def test_an_unreadable_peer_is_not_a_disagreement() -> None:
    clock, events, m = Clock(), Events(), Checked(seen=None)
    dog = watchdog(m, clock, events)
    for _ in range(5):
        clock.now += 30
        dog.evaluate()
    assert m.repairs == [] and dog.checks == 0


def test_a_repair_request_stops_a_registered_server_which_pauses_before_it_registers_again() -> None:
    seen = Observation(
        now=1.0, serving=True, socket_present=True, kubelet_stream_open=True, accepted=True, stream_seen=True
    )
    assert decide(seen).action is Action.IDLE
    step = decide(dataclasses.replace(seen, repair="the kubelet counts 0"))
    assert step.action is Action.STOP and step.reason == "watchdog: the kubelet counts 0"
    stopped = Observation(
        now=1.0, serving=False, socket_present=False, kubelet_stream_open=False, accepted=False, stream_seen=False
    )
    assert decide(dataclasses.replace(stopped, paused_until=1.5)) == Step(Action.WAIT, until=1.5)
    assert decide(dataclasses.replace(stopped, now=1.5, paused_until=1.5)).action is Action.START


def test_node_allocatable_keeps_whole_extended_resources_only() -> None:
    node = {"status": {"allocatable": {"cpu": "64", "nvidia.com/gpu": "8", "example.com/x": "1500m", "a/b": 3}}}
    assert allocatable_of(node) == {"nvidia.com/gpu": 8, "a/b": 3}
    assert allocatable_of({"status": "garbage"}) == {} and allocatable_of([]) == {}


# --- the device plugin, for real ---------------------------------------------------------------


@contextlib.asynccontextmanager
async def plugin_with_kubelet_view() -> AsyncIterator[tuple[PluginHarness, FakePodResources, PodResourcesWatcher]]:
    async with plugin_harness() as h:
        await h.settled()
        pods = FakePodResources(h.root / "pod-resources")
        await pods.start()
        watcher = PodResourcesWatcher(PodResourcesClient(pods.socket), allocatable_every_s=0)
        h.manager.pod_resources = watcher  # polled by the test, not by the manager
        try:
            yield h, pods, watcher
        finally:
            await pods.stop()


def healthy_ids(h: PluginHarness) -> list[str]:
    return sorted(d.device.id for d in h.manager.servers[GPU].advertised() if d.healthy)


@pytest.mark.integration
async def test_the_kubelet_losing_our_devices_is_repaired_by_registering_again() -> None:
    """The kubelet holds our stream but counts no allocatable GPU: past the grace period the server
    restarts through its reconcile loop and registers once more; then both sides agree."""
    async with plugin_with_kubelet_view() as (h, pods, watcher):
        clock, events = Clock(), Events()
        dog = Watchdog(
            mechanisms={"device-plugin": h.manager}, node=NoApiNodeStatus(), config=config(), events=events, clock=clock
        )
        pods.allocatable = {GPU: healthy_ids(h)}
        await watcher.poll()
        dog.evaluate()
        assert dog.checks == 1 and dog.debug_state()["disagreements"] == []
        assert h.manager.debug_state()["pod_resources"]["kubelet_allocatable"] == {GPU: 8}  # type: ignore[index]

        process = h.kubelet.current
        assert process is not None and process.registrations(GPU) == 1
        pods.allocatable = {}  # the kubelet lost track of us
        await watcher.poll()
        dog.evaluate()
        clock.now += 31
        dog.evaluate()
        assert dog.repairs == 1
        await wait_for(lambda: process.registrations(GPU) == 2, what="a second registration")
        await h.settled()
        assert process.registrations(GPU) == 2 and process.dropped_new == 0  # once, after the kubelet let go
        assert h.manager.servers[GPU].repairs == 1
        assert h.manager.servers[GPU].last_restart_reason.startswith("watchdog: the kubelet counts 0 allocatable")

        pods.allocatable = {GPU: healthy_ids(h)}  # the kubelet counts them again
        await watcher.poll()
        dog.evaluate()
        assert dog.debug_state()["disagreements"] == [] and dog.readiness().ok
        assert [r for _, r, _ in events.sent] == ["AdvertisementDiverged", "AdvertisementRepaired"]


@pytest.mark.integration
async def test_the_kubelet_still_counting_gpus_while_we_cannot_register_fails_readiness() -> None:
    """The safety net: our stream is gone and the kubelet refuses us, yet it still counts 8 GPUs."""
    async with plugin_with_kubelet_view() as (h, pods, watcher):
        clock, events = Clock(), Events()
        dog = Watchdog(
            mechanisms={"device-plugin": h.manager}, node=NoApiNodeStatus(), config=config(), events=events, clock=clock
        )
        pods.allocatable = {GPU: healthy_ids(h)}
        h.kubelet.reject = "the kubelet is in trouble"
        process = h.kubelet.current
        assert process is not None
        process.drop(GPU)
        await wait_for(lambda: not h.manager.servers[GPU].registered, what="our stream to end")
        await watcher.poll()
        dog.evaluate()
        for _ in range(10):
            clock.now += 300
            dog.evaluate()
        readiness = dog.readiness()
        assert not readiness.ok
        assert "the kubelet counts 8 allocatable nvidia.com/gpu, we list 0 healthy (not registered" in readiness.detail
        assert dog.repairs >= 3


@pytest.mark.integration
async def test_node_status_from_the_node_watch_is_compared_too(tmp_path: Path) -> None:
    """The Node's allocatable comes from the Node watch the agent keeps for its labels: no request per round."""
    async with serving() as api, plugin_harness() as h:
        await h.settled()
        kubeconfig = write_kubeconfig(tmp_path, api.url)
        async with KubeClient(kubeconfig_access(kubeconfig)) as client:
            node = NodeLabelSource(client, node_name=NODE)
            assert node.status.allocatable is None and "not been read" in node.status.reason
            clock, events = Clock(), Events()
            dog = Watchdog(
                mechanisms={"device-plugin": h.manager}, node=node, config=config(), events=events, clock=clock
            )
            watching = asyncio.create_task(node.watch(lambda labels: None))
            try:
                await wait_for(lambda: node.status.allocatable == {}, what="the listed Node")  # 0 of ours yet
                api.set_allocatable({GPU: "8", "cpu": "64"})
                await wait_for(lambda: node.status.allocatable == {GPU: 8}, what="the status from the watch")
                dog.evaluate()
                assert dog.checks == 1 and dog.debug_state()["disagreements"] == []
                api.set_allocatable({GPU: "7"})
                await wait_for(lambda: node.status.allocatable == {GPU: 7}, what="the next status")
                for _ in range(3):
                    await node.refresh()  # the watchdog's call each round: nothing to ask
                    dog.evaluate()
                clock.now += 30
                dog.evaluate()
                assert dog.repairs == 1
                # the watchdog's rounds asked the API server nothing: one list, one stream
                assert [(r.method, r.path, r.query.get("watch")) for r in api.requests] == [
                    ("GET", "/api/v1/nodes", None),
                    ("GET", "/api/v1/nodes", "true"),
                ]
                # a watch that fails makes the status unknown (the node checks are skipped), with the reason
                api.fail(503, times=None, path="/api/v1/nodes")
                api.close_watches()
                await wait_for(lambda: node.status.allocatable is None, what="the failure")
                assert node.status.reason.startswith("the Node watch is not current: watch ")
            finally:
                watching.cancel()
                await asyncio.gather(watching, return_exceptions=True)


# --- DRA ---------------------------------------------------------------------------------------


@pytest.mark.integration
async def test_slices_that_do_not_hold_the_pool_are_read_again_and_republished() -> None:
    async with dra_harness() as h:
        clock, events = Clock(), Events()
        dog = Watchdog(mechanisms={"dra": h.m}, node=NoApiNodeStatus(), config=config(), events=events, clock=clock)
        names = frozenset({"gpu-0", "gpu-1"})
        h.publisher.check = (names, names)
        dog.evaluate()
        assert dog.checks == 1
        h.publisher.check = (names, frozenset({"gpu-0"}))
        dog.evaluate()
        clock.now += 30
        dog.evaluate()
        assert h.publisher.resyncs == 1
        (disagreement,) = dog.debug_state()["disagreements"]  # type: ignore[misc]
        assert disagreement["detail"] == "the pool should hold 2 devices, its ResourceSlices hold 1; missing: gpu-1"
        h.publisher.check = None  # unknown (re-listing): skipped, and the disagreement is over
        dog.evaluate()
        assert dog.debug_state()["disagreements"] == []
