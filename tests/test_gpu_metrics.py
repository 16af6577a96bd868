"""Per-GPU series on /metrics and the matching /debug/state fields, from a real Agent's registry.

Series are generated at scrape time from live state, so the metric set follows the node: a pod
that goes takes its series with it (500 short-lived pods leave the exposition as it was), label
values from outside are escaped and cut, and holder series are capped with a count of the rest.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.backends.simulated import SimulatedBackend
from agent.cdi.service import NullCdiService
from agent.core.config.current import ConfigState
from agent.core.config.loader import LoadedConfig, build_config
from agent.core.config.schema import Owner
from agent.core.health.model import Signal, SignalKind
from agent.core.health.monitor import HealthMonitor
from agent.core.inventory.current import InventoryState
from agent.core.mechanism import Holder, NodeStatus, Readiness, RegistrationCheck, Usage
from agent.core.node import NodeFacts
from agent.core.ownership.table import OwnershipState
from agent.observe.metrics.gpus import GpuCollector
from agent.runtime.agent import Agent
from agent.runtime.assemble import build_agent
from tests.test_plugin_fakes import ownership_for


@dataclass
class FakeMechanism:
    owner: Owner = Owner.DEVICE_PLUGIN
    holders: dict[str, tuple[Holder, ...]] = field(default_factory=dict)

    async def run(self) -> None:  # pragma: no cover - never run here
        raise AssertionError

    def readiness(self) -> Readiness:
        return Readiness(True)

    def debug_state(self) -> dict[str, object]:
        return {}

    def advertised_gpus(self) -> frozenset[str]:
        return frozenset()

    def usage(self) -> Usage:
        return Usage(known=True, holders=dict(self.holders))

    def registration_checks(self, node: NodeStatus) -> Sequence[RegistrationCheck]:
        return []

    def gpu_details(self) -> dict[str, dict[str, object]]:
        return {}


@dataclass
class Node:
    agent: Agent
    plugin: FakeMechanism
    dra: FakeMechanism
    registry: CollectorRegistry

    @property
    def uuids(self) -> list[str]:
        return [g.uuid for g in self.agent.inventory.gpus]

    def scrape(self) -> str:
        return generate_latest(self.registry).decode()

    def samples(self, name: str) -> list[dict[str, str]]:
        out = []
        for family in text_string_to_metric_families(self.scrape()):
            for sample in family.samples:
                if sample.name == name:
                    out.append({**sample.labels, "value": str(sample.value)})
        return out

    def series(self) -> int:
        return sum(1 for line in self.scrape().splitlines() if line and not line.startswith("#"))


@pytest.fixture
async def node() -> Iterator[Node]:
    config = build_config({"metrics": {"max_holder_series": 16}})
    backend = SimulatedBackend(preset="h100-8x-nvlink", node_name="n", health=config.health)
    inventory = await backend.load()
    monitor = HealthMonitor(config=config.health)
    monitor.set_inventory(inventory)
    registry = CollectorRegistry()
    plugin, dra = FakeMechanism(), FakeMechanism(owner=Owner.DRA)
    agent = build_agent(
        config_state=ConfigState(LoadedConfig(config=config, version="t", source="test")),
        node_name="n",
        backend=backend,
        node=NodeFacts(
            inventory=InventoryState(inventory),
            health=monitor,
            ownership=OwnershipState(ownership_for(inventory, {"7": Owner.DRA})),
        ),
        cdi=NullCdiService(),
        mechanisms={"device-plugin": plugin, "dra": dra},  # type: ignore[dict-item]
        registry=registry,
    )
    yield Node(agent, plugin, dra, registry)  # type: ignore[misc]


def test_one_info_and_one_health_series_per_gpu_labelled_by_uuid(node: Node) -> None:
    info = node.samples("gpu_agent_gpu_info")
    assert sorted(s["uuid"] for s in info) == sorted(node.uuids)
    by_index = {s["index"]: s for s in info}
    assert by_index["7"]["owner"] == "dra" and by_index["0"]["owner"] == "device-plugin"
    assert by_index["0"]["product"] == "NVIDIA H100 80GB HBM3" and by_index["0"]["desired_owner"] == "device-plugin"
    health = node.samples("gpu_agent_gpu_health")
    assert {s["state"] for s in health} == {"healthy"} and len(health) == 8

    node.agent.health.observe(Signal(node.uuids[2], SignalKind.XID, xid=79, detail="fell off the bus"))
    node.agent.health.observe(Signal(node.uuids[2], SignalKind.XID, xid=13, detail="application"))
    node.agent.health.observe(Signal(node.uuids[2], SignalKind.XID, xid=13, detail="application"))
    (sick,) = [s for s in node.samples("gpu_agent_gpu_health") if s["uuid"] == node.uuids[2]]
    assert sick["state"] == "unhealthy" and sick["reason"] == "Xid 79: fell off the bus"
    xids = {s["xid"]: s["value"] for s in node.samples("gpu_agent_gpu_xid_events_total") if s["index"] == "2"}
    assert xids == {"79": "1.0", "13": "2.0"}  # an Xid the policy ignores is still counted
    assert node.agent.state()["devices"][2]["xids"] == {"13": 2, "79": 1}


def test_holders_are_an_info_metric_to_join_on(node: Node) -> None:
    node.plugin.holders = {node.uuids[3]: (Holder("container", "ml", "train-0", detail="main", devices=("x",)),)}
    node.dra.holders = {node.uuids[7]: (Holder("claim", "ml", "c1", uid="claim-uid"),)}
    holders = {s["uuid"]: s for s in node.samples("gpu_agent_gpu_holder_info")}
    assert holders[node.uuids[3]] == {
        "uuid": node.uuids[3],
        "index": "3",
        "mechanism": "device-plugin",
        "namespace": "ml",
        "pod": "train-0",
        "pod_uid": "",
        "container": "main",
        "claim": "",
        "claim_uid": "",
        "value": "1.0",
    }
    assert holders[node.uuids[7]]["claim"] == "c1" and holders[node.uuids[7]]["claim_uid"] == "claim-uid"
    assert holders[node.uuids[7]]["mechanism"] == "dra" and holders[node.uuids[7]]["pod"] == ""


def test_a_claim_gets_one_holder_series_per_pod_it_is_reserved_for(node: Node) -> None:
    node.dra.holders = {node.uuids[7]: (Holder("claim", "ml", "shared", uid="c-uid"),)}
    pods = {("ml", "shared", "c-uid"): (("a", "uid-a"), ("b", "uid-b"))}
    collector = GpuCollector(
        node=NodeFacts(inventory=node.agent.inventories, health=node.agent.health, ownership=node.agent.ownership),
        mechanisms=node.agent.mechanisms,
        utilization=node.agent.observers.utilization,
        config=node.agent.config_state,
        claim_pods=lambda namespace, name, uid: pods.get((namespace, name, uid), ()),
    )
    registry = CollectorRegistry()
    registry.register(collector)
    rows = [
        (s.labels["pod"], s.labels["pod_uid"], s.labels["claim"])
        for family in registry.collect()
        for s in family.samples
        if s.name == "gpu_agent_gpu_holder_info"
    ]
    assert rows == [("a", "uid-a", "shared"), ("b", "uid-b", "shared")]


def test_label_values_from_outside_are_escaped_and_cut(node: Node) -> None:
    weird = 'we"ird\\pod\nname'
    long = "c" * 500
    node.plugin.holders = {node.uuids[0]: (Holder("container", "ml", weird, detail=long),)}
    text = node.scrape()
    assert 'pod="we\\"ird\\\\pod\\nname"' in text  # one line per series, whatever the kubelet sent
    (holder,) = node.samples("gpu_agent_gpu_holder_info")
    assert holder["pod"] == weird and holder["container"] == "c" * 125 + "..."


def test_holder_series_are_capped_and_the_rest_counted(node: Node) -> None:
    node.plugin.holders = {
        uuid: tuple(Holder("container", "ml", f"pod-{i}-{j}", detail="main") for j in range(5))
        for i, uuid in enumerate(node.uuids)
    }
    shown = node.samples("gpu_agent_gpu_holder_info")
    assert len(shown) == 16
    assert {s["index"] for s in shown} == {"0", "1", "2", "3"}  # a stable order: by GPU index, then name
    assert node.samples("gpu_agent_gpu_holder_series_dropped")[0]["value"] == "24.0"


async def test_the_metric_set_stays_bounded_after_500_short_lived_pods(node: Node) -> None:
    baseline = node.series()
    largest = baseline
    pod = 0
    for _ in range(50):
        node.plugin.holders = {}
        for _ in range(10):  # ten pods at a time, each on a GPU, then gone
            uuid = node.uuids[pod % 7]
            node.plugin.holders[uuid] = (
                *node.plugin.holders.get(uuid, ()),
                Holder("container", f"ns-{pod}", f"job-{pod}-{'x' * (pod % 40)}", detail="main"),
            )
            pod += 1
        await node.agent.observers.orphans.check()
        largest = max(largest, node.series())
    node.plugin.holders = {}
    await node.agent.observers.orphans.check()
    assert pod == 500
    assert largest <= baseline + 10
    assert node.series() == baseline
    assert node.agent.observers.orphans.debug_state()["watched_subjects"] == 0


async def test_utilization_series_appear_once_read_and_state_shows_them(node: Node) -> None:
    assert node.samples("gpu_agent_gpu_utilization_ratio") == []
    assert {s["value"] for s in node.samples("gpu_agent_gpu_utilization_known")} == {"0.0"}
    state = node.agent.state()["devices"][0]["utilization"]
    assert state["known"] is False and state["gpu_percent"] is None and state["reason"] == "not sampled yet"

    node.plugin.holders = {node.uuids[1]: (Holder("container", "ml", "busy", detail="main"),)}
    await node.agent.observers.utilization.sample_once()
    ratios = {s["index"]: float(s["value"]) for s in node.samples("gpu_agent_gpu_utilization_ratio")}
    assert len(ratios) == 8 and ratios["0"] == 0.0 and 0.4 <= ratios["1"] <= 0.95
    totals = {s["index"]: float(s["value"]) for s in node.samples("gpu_agent_gpu_memory_total_bytes")}
    assert totals["0"] == 81559 * 1024 * 1024
    device = node.agent.state()["devices"][1]
    assert device["utilization"]["known"] is True and device["utilization"]["memory_total_mib"] == 81559
    assert node.agent.state()["utilization"]["results"]["ok"] == 1
