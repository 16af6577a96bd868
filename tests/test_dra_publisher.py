"""The ResourceSlice publisher against the fake API server, with the real client."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent.backends.simulated import SimulatedBackend
from agent.base.backoff import Backoff
from agent.core.config.schema import HealthConfig, NodeMatch, NodeRule, Owner, OwnershipConfig
from agent.core.health.model import Signal, SignalKind
from agent.core.health.monitor import HealthMonitor
from agent.core.inventory.current import InventoryState
from agent.core.inventory.model import Inventory
from agent.core.node import NodeFacts
from agent.core.ownership.table import OwnershipState, compute_ownership
from agent.dra.devices import dra_devices
from agent.dra.slices.publisher import KubeSlicePublisher
from agent.kube.access import kubeconfig_access
from agent.kube.client import KubeClient, Limits
from tests.fake_apiserver import NODE, TIMEOUT, FakeApiServer, serving, write_kubeconfig
from tests.fake_sleep import FakeSleep

DRIVER = "gpu-node-agent.nvidia.com"


async def until(condition: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not condition():  # noqa: ASYNC110 - state lives in two places (fake server, publisher)
            await asyncio.sleep(0.005)
    assert condition(), what


@dataclass
class Node:
    inventory: InventoryState
    health: HealthMonitor
    ownership: OwnershipState
    registry: CollectorRegistry

    def own(self, default: Owner, **per_gpu: Owner) -> None:
        """Set the ownership (``per_gpu`` by index, e.g. ``**{"0": Owner.DEVICE_PLUGIN}``)."""
        rule = NodeRule(match=NodeMatch(names=(NODE,)), default=default, gpus=dict(per_gpu))
        config = OwnershipConfig(default=default, nodes=(rule,))
        self.ownership.update(
            compute_ownership(self.inventory.current, config, node_name=NODE, node_labels={}, version="t")
        )

    def fault(self, index: int) -> str:
        uuid = self.inventory.current.gpus[index].uuid
        self.health.observe(Signal(uuid, SignalKind.INJECTED_FAULT, detail="test"))
        return uuid

    def heal(self, index: int) -> None:
        self.health.observe(Signal(self.inventory.current.gpus[index].uuid, SignalKind.INJECTED_HEAL))


async def _inventory(preset: str = "h100-8x-nvlink") -> Inventory:
    return await SimulatedBackend(preset=preset, node_name=NODE, health=HealthConfig()).load()


def _node(inventory: Inventory, default: Owner = Owner.DRA) -> Node:
    health = HealthMonitor(config=HealthConfig())
    health.set_inventory(inventory)
    ownership = OwnershipState()
    node = Node(InventoryState(inventory), health, ownership, CollectorRegistry())
    node.own(default)
    return node


@contextlib.asynccontextmanager
async def publishing(
    api: FakeApiServer,
    tmp_path: Path,
    node: Node,
    *,
    limits: Limits | None = None,
    sleep: Any = None,
) -> AsyncIterator[KubeSlicePublisher]:
    async with KubeClient(kubeconfig_access(write_kubeconfig(tmp_path, api.url)), limits=limits) as client:
        publisher = KubeSlicePublisher(
            client=client,
            node_name=NODE,
            driver_name=DRIVER,
            node=NodeFacts(inventory=node.inventory, health=node.health, ownership=node.ownership),
            registry=node.registry,
            backoff=Backoff(initial_s=0.01, max_s=0.05),
            **({"sleep": sleep} if sleep else {}),
        )
        task = asyncio.create_task(publisher.run(), name="publisher")
        try:
            yield publisher
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _devices(api: FakeApiServer) -> list[str]:
    return [d["name"] for s in api.slices_of() for d in s["spec"]["devices"]]


def _generations(api: FakeApiServer) -> set[int]:
    return {s["spec"]["pool"]["generation"] for s in api.slices_of()}


async def _published(api: FakeApiServer, publisher: KubeSlicePublisher, names: list[str]) -> None:
    await until(lambda: sorted(_devices(api)) == sorted(names) and publisher.readiness().ok, f"published {names}")


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    async with serving() as fake:
        yield fake


# --- publishing ----------------------------------------------------------------------------


async def test_publishes_every_dra_device_in_one_valid_slice(api: FakeApiServer, tmp_path: Path) -> None:
    inventory = await _inventory()
    node = _node(inventory)
    async with publishing(api, tmp_path, node) as publisher:
        await _published(api, publisher, [d.name for d in dra_devices(inventory)])
        (stored,) = api.slices_of()
        assert stored["spec"]["driver"] == DRIVER and stored["spec"]["nodeName"] == NODE
        assert stored["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
        assert stored["metadata"]["name"].startswith(f"{NODE}-{DRIVER}-")
        assert stored["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": f"uid-{NODE}", "controller": True}
        ]
        assert publisher.published_gpus() == {g.uuid for g in inventory.gpus}
        state = publisher.debug_state()
        assert state["api_version"] == "resource.k8s.io/v1" and state["generation"] == 1
        assert state["writes"] == {"create": 1, "update": 0, "delete": 0} and state["last_error"] is None
        assert "8 devices in 1 ResourceSlices, generation 1" in publisher.readiness().detail
    value = node.registry.get_sample_value
    assert value("gpu_agent_dra_slice_writes_total", {"action": "create"}) == 1
    assert value("gpu_agent_dra_published_devices") == 8 and value("gpu_agent_dra_pool_generation") == 1
    assert value("gpu_agent_dra_slice_last_write_timestamp_seconds")


async def test_zero_writes_in_steady_state(api: FakeApiServer, tmp_path: Path) -> None:
    inventory = await _inventory()
    node = _node(inventory)
    async with publishing(api, tmp_path, node) as publisher:
        await _published(api, publisher, [d.name for d in dra_devices(inventory)])
        writes = api.slice_writes()
        for _ in range(5):
            syncs = publisher.syncs
            publisher.kick()
            await until(lambda: publisher.syncs > syncs, "another sync")  # noqa: B023
        api.end_watches()  # a watch that ends is resumed; its list of unchanged slices changes nothing
        await api.next_watch()
        node.inventory.update(inventory)  # the same inventory again: no change
        node.own(Owner.DRA)  # the same ownership again
        api.bookmark()
        syncs = publisher.syncs
        publisher.kick()
        await until(lambda: publisher.syncs > syncs, "a last sync")
        assert api.slice_writes() == writes == 1


async def test_one_write_per_health_change_with_taints(api: FakeApiServer, tmp_path: Path) -> None:
    inventory = await _inventory()
    node = _node(inventory)
    async with publishing(api, tmp_path, node) as publisher:
        names = [d.name for d in dra_devices(inventory)]
        await _published(api, publisher, names)
        writes = api.slice_writes()
        node.fault(2)

        def tainted() -> list[dict[str, Any]]:
            return [t for s in api.slices_of() for d in s["spec"]["devices"] for t in d.get("taints", [])]

        await until(lambda: len(tainted()) == 1, "the device tainted")
        assert tainted()[0]["key"] == f"{DRIVER}/unhealthy" and tainted()[0]["effect"] == "NoSchedule"
        assert tainted()[0]["value"] == "marked-unhealthy-test"
        assert sorted(_devices(api)) == sorted(names)  # it stays, tainted
        assert api.slice_writes() == writes + 1 and _generations(api) == {2}
        assert api.count("POST", "/resourceslices") == 2  # the create, and one dry run to learn taints are kept
        assert publisher.debug_state()["taints_supported"] is True
        node.heal(2)
        await until(lambda: not tainted(), "the taint removed")
        assert api.slice_writes() == writes + 2 and _generations(api) == {3}


async def test_unhealthy_devices_leave_the_slice_where_taints_are_dropped(tmp_path: Path) -> None:
    async with serving(taints=False) as api:
        inventory = await _inventory()
        node = _node(inventory)
        async with publishing(api, tmp_path, node) as publisher:
            names = [d.name for d in dra_devices(inventory)]
            await _published(api, publisher, names)
            writes = api.slice_writes()
            node.fault(0)
            await _published(api, publisher, names[1:])
            assert api.slice_writes() == writes + 1
            assert publisher.debug_state()["taints_supported"] is False
            # the API holds the new slice a moment before the publisher has read the answer to its
            # write; until then the GPU still counts as (maybe) published
            await until(lambda: inventory.gpus[0].uuid not in publisher.published_gpus(), "the write answered")
            node.fault(1)  # support is known now: no second dry run
            await _published(api, publisher, names[2:])
            assert api.count("POST", "/resourceslices") == 2 and api.slice_writes() == writes + 2


async def test_taints_dropped_on_a_real_write_are_noticed(api: FakeApiServer, tmp_path: Path) -> None:
    inventory = await _inventory()
    node = _node(inventory)
    async with publishing(api, tmp_path, node) as publisher:
        names = [d.name for d in dra_devices(inventory)]
        await _published(api, publisher, names)
        node.fault(0)
        await until(lambda: publisher.debug_state()["taints_supported"] is True, "taints kept")
        api.taints = False  # an apiserver without the gate takes over
        node.fault(1)
        await _published(api, publisher, names[2:])
        assert publisher.debug_state()["taints_supported"] is False


async def test_health_unknown_counts_as_not_healthy(tmp_path: Path) -> None:
    async with serving(taints=False) as api:
        inventory = await _inventory()
        node = _node(inventory)
        node.health.set_inventory(Inventory(backend="x", driver_version="", cuda_driver_version="", gpus=()))
        async with publishing(api, tmp_path, node) as publisher:
            await until(lambda: publisher.readiness().ok, "published")
            assert api.slices_of() == [] and api.slice_writes() == 0  # nothing healthy, nothing to publish


async def test_slices_deleted_behind_its_back_come_back(api: FakeApiServer, tmp_path: Path) -> None:
    inventory = await _inventory()
    node = _node(inventory)
    async with publishing(api, tmp_path, node) as publisher:
        names = [d.name for d in dra_devices(inventory)]
        await _published(api, publisher, names)
        assert api.delete_slices(node=NODE) == 1  # the kubelet starting
        await _published(api, publisher, names)
        assert _generations(api) == {2}
        first = api.slices_of()[0]["metadata"]["name"]
        api.edit_slice(first, lambda spec: spec["devices"].pop())  # someone edits it
        await until(lambda: len(_devices(api)) == len(names) and _generations(api) == {3}, "the edit undone")
        # deleted while the watch was cut: the resumed watch replays the deletion
        api.close_watches()
        api.delete_slices()
        await until(lambda: _generations(api) == {4} and len(_devices(api)) == len(names), "back after a cut watch")
        # deleted while the watch's history expired: the relist finds them missing
        api.end_watches()
        api.delete_slices()
        api.compact()
        await until(lambda: _generations(api) == {5} and len(_devices(api)) == len(names), "back after a relist")


async def test_a_big_pool_is_split_at_128_devices(api: FakeApiServer, tmp_path: Path) -> None:
    base = (await _inventory()).gpus[0]
    gpus = tuple(dataclasses.replace(base, uuid=f"GPU-{i:04d}", index=i, minor=i) for i in range(300))
    inventory = Inventory(backend="simulated", driver_version="570.1.2", cuda_driver_version="12.8", gpus=gpus)
    node = _node(inventory)
    async with publishing(api, tmp_path, node) as publisher:
        await _published(api, publisher, [f"gpu-{i}" for i in range(300)])
        slices = api.slices_of()
        assert sorted(len(s["spec"]["devices"]) for s in slices) == [44, 128, 128]
        assert {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices} == {(1, 3)}
        # 170 GPUs move to the device plugin: one slice fewer, all at the next generation
        node.own(Owner.DRA, **{str(i): Owner.DEVICE_PLUGIN for i in range(170)})
        await _published(api, publisher, [f"gpu-{i}" for i in range(170, 300)])
        slices = api.slices_of()
        assert sorted(len(s["spec"]["devices"]) for s in slices) == [2, 128]
        assert {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices} == {(2, 2)}


async def test_a_conflict_is_reread_and_retried(api: FakeApiServer, tmp_path: Path) -> None:
    inventory = await _inventory()
    node = _node(inventory, default=Owner.DRA)
    async with publishing(api, tmp_path, node) as publisher:
        names = [d.name for d in dra_devices(inventory)]
        await _published(api, publisher, names)
        lists = api.count("GET", "/resourceslices", watch=False)
        api.fail(409, method="PUT", message="Operation cannot be fulfilled: the object has been modified")
        node.own(Owner.DRA, **{"0": Owner.NONE})
        await _published(api, publisher, names[1:])
        assert publisher.errors == 1 and publisher.last_error == ""
        assert api.count("GET", "/resourceslices", watch=False) == lists + 1  # re-read before retrying


async def test_an_outage_backs_off_and_never_spins(api: FakeApiServer, tmp_path: Path) -> None:
    inventory = await _inventory()
    node = _node(inventory)
    api.fail(503, times=None)
    sleep = FakeSleep()
    async with publishing(api, tmp_path, node, sleep=sleep) as publisher:
        for _ in range(12):
            await sleep.release()
        # every request that failed was followed by a backoff; nothing ran between them
        assert api.count() <= len(sleep.delays) + 2
        assert not publisher.readiness().ok and "503" in publisher.readiness().detail
        assert publisher.published_gpus() == {g.uuid for g in inventory.gpus}  # unknown: all may be published
        api.clear()
        while not publisher.readiness().ok:
            sleep.release_all()
            await asyncio.sleep(0.005)
        await _published(api, publisher, [d.name for d in dra_devices(inventory)])
    assert max(sleep.delays) >= 4 * min(sleep.delays)  # exponential


async def test_a_node_without_dra_gpus_writes_nothing(api: FakeApiServer, tmp_path: Path) -> None:
    inventory = await _inventory()
    node = _node(inventory, default=Owner.DEVICE_PLUGIN)
    async with publishing(api, tmp_path, node) as publisher:
        await until(lambda: publisher.readiness().ok, "synced")
        assert api.slice_writes() == 0 and publisher.published_gpus() == frozenset()
        node.own(Owner.DRA, **{"3": Owner.DEVICE_PLUGIN})
        await until(lambda: len(_devices(api)) == 7, "published")
        node.own(Owner.DEVICE_PLUGIN)
        await until(lambda: api.slices_of() == [], "all withdrawn")
        assert publisher.published_gpus() == frozenset()


# --- the handover window -------------------------------------------------------------------


async def test_published_gpus_covers_every_write_until_it_is_known_to_be_gone(
    api: FakeApiServer, tmp_path: Path
) -> None:
    inventory = await _inventory()
    node = _node(inventory, default=Owner.DRA)
    node.own(Owner.DRA, **{"7": Owner.DEVICE_PLUGIN})
    gpu0, gpu7 = inventory.gpus[0].uuid, inventory.gpus[7].uuid
    limits = Limits(request_timeout_s=0.3)
    async with publishing(api, tmp_path, node, limits=limits) as publisher:
        await _published(api, publisher, [d.name for d in dra_devices(inventory)][:7])
        assert gpu7 not in publisher.published_gpus()

        # a GPU being added counts from the moment the write is attempted
        api.hang(method="PUT")
        node.own(Owner.DRA)
        await until(lambda: api.count("PUT") == 1, "the write sent")
        assert gpu7 in publisher.published_gpus()  # the write hangs: it may land
        await until(lambda: publisher.last_error != "", "the write timed out")
        assert gpu7 in publisher.published_gpus()  # it timed out: it may have landed
        await until(lambda: len(_devices(api)) == 8, "published on retry")

        # a GPU being removed counts until a write without it has succeeded
        api.hang(times=3, method="PUT")
        node.own(Owner.DRA, **{"0": Owner.DEVICE_PLUGIN})
        await until(lambda: api.count("PUT") >= 3, "the write sent")
        assert gpu0 in publisher.published_gpus()
        await until(lambda: "gpu-0" not in _devices(api) and publisher.readiness().ok, "withdrawn")
        assert gpu0 not in publisher.published_gpus()


async def test_before_the_first_list_every_gpu_counts_as_published(api: FakeApiServer, tmp_path: Path) -> None:
    inventory = await _inventory()
    node = _node(inventory, default=Owner.DEVICE_PLUGIN)
    api.hang(times=None)
    async with publishing(api, tmp_path, node, limits=Limits(request_timeout_s=0.2)) as publisher:
        assert publisher.published_gpus() == {g.uuid for g in inventory.gpus}
        api.clear()
        await until(lambda: publisher.readiness().ok, "synced")
        assert publisher.published_gpus() == frozenset()


# --- API versions --------------------------------------------------------------------------


@pytest.mark.parametrize("versions", [("v1beta1",), ("v1beta1", "v1beta2")])
async def test_beta_versions_are_spoken_in_their_shape(tmp_path: Path, versions: tuple[str, ...]) -> None:
    async with serving(versions=versions) as api:
        inventory = await _inventory("a100-4x-mig")
        node = _node(inventory)
        async with publishing(api, tmp_path, node) as publisher:
            names = [d.name for d in dra_devices(inventory)]
            await _published(api, publisher, names)
            (create,) = [r for r in api.requests if r.method == "POST"]
            device = create.body["spec"]["devices"][0]
            assert ("basic" in device) is (versions == ("v1beta1",))
            assert create.path.startswith(f"/apis/resource.k8s.io/{versions[-1]}/")
            writes = api.slice_writes()
            syncs = publisher.syncs
            publisher.kick()
            await until(lambda: publisher.syncs > syncs, "a sync")
            assert api.slice_writes() == writes  # what it reads back in that shape compares equal


async def test_an_apiserver_downgrade_is_rediscovered(api: FakeApiServer, tmp_path: Path) -> None:
    inventory = await _inventory()
    node = _node(inventory)
    async with publishing(api, tmp_path, node) as publisher:
        names = [d.name for d in dra_devices(inventory)]
        await _published(api, publisher, names)
        api.versions = ("v1beta1",)
        api.delete_slices()
        await until(
            lambda: publisher.debug_state()["api_version"] == "resource.k8s.io/v1beta1" and len(_devices(api)) == 8,
            "republished through v1beta1",
        )


async def test_no_resource_api_at_all_is_a_clear_reason(tmp_path: Path) -> None:
    async with serving(versions=()) as api:
        node = _node(await _inventory())
        async with publishing(api, tmp_path, node) as publisher:
            await until(lambda: "does not serve resource.k8s.io" in publisher.readiness().detail, "the reason")
            assert publisher.published_gpus() == frozenset()  # nothing can be in a slice


async def test_a_node_without_gpus_talks_to_nobody_until_gpus_appear(api: FakeApiServer, tmp_path: Path) -> None:
    inventory = await _inventory()
    node = _node(Inventory.empty("nvml"))
    async with publishing(api, tmp_path, node) as publisher:
        await until(lambda: node.inventory.changes.subscriber_count == 1, "waiting for GPUs")
        assert api.requests == [] and publisher.published_gpus() == frozenset()
        node.health.set_inventory(inventory)
        node.inventory.update(inventory)
        node.own(Owner.DRA)
        await _published(api, publisher, [d.name for d in dra_devices(inventory)])
