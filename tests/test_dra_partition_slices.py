"""Counters and shared devices in ResourceSlices: the pure plan, the JSON, and the publisher
against the fake API server (gates on, gates off, v1beta1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.core.config.loader import build_config
from agent.core.config.schema import Owner
from agent.core.ownership.publish import PublishState, compute_publish_modes
from agent.dra.devices import dra_devices
from agent.dra.modes import ApiSupport, ModeGate
from agent.dra.partitions import CounterSet
from agent.dra.slices.codec import parse_slice, slice_body
from agent.dra.slices.plan import CounterSlice, SliceDevice, StoredSlice, desired_slices, plan, split
from tests.fake_apiserver import NODE, FakeApiServer, serving
from tests.partition_fakes import mig_capable
from tests.test_dra_publisher import DRIVER, Node, _inventory, _node, publishing, until


def _gate(node: Node, publish: object) -> ModeGate:
    config = build_config({"dra": {"publish": publish}})
    state = PublishState(compute_publish_modes(node.inventory.current, config.dra, node_name=NODE, node_labels={}))
    return ModeGate(inventory=node.inventory, publish=state)


async def _mig_node() -> Node:
    return _node(mig_capable(await _inventory()))


def _desired(node: Node, gate: ModeGate) -> tuple[object, ...]:
    desired = desired_slices(
        gate.devices(),
        ownership=node.ownership.current,
        health=node.health,
        driver=DRIVER,
        taints=False,
        counter_sets=gate.counter_sets(),
    )
    assert desired is not None
    return desired


# --- pure ----------------------------------------------------------------------------------


async def test_devices_are_built_again_only_when_a_shape_or_the_inventory_changes() -> None:
    """Every prepare moves the claim version, and the refresh after it built every device of
    the node again (two thirds of the refresh) although a whole-GPU claim changes no shape."""
    node = await _mig_node()
    gate = _gate(node, "dynamic-mig")
    version = [0]
    gate.attach(held=tuple, instances=tuple, version=lambda: version[0])
    gate.set_support(ApiSupport(counters=True, shared=True))
    devices, counters = gate.devices(), gate.counter_sets()
    version[0] += 1  # a claim prepared or unprepared
    assert not gate.refresh()
    assert gate.devices() is devices and gate.counter_sets() is counters
    gate.set_support(ApiSupport(counters=False, shared=True, reason="dropped"))  # the shapes change
    assert gate.devices() != devices and not gate.counter_sets()
    node.inventory.update(await _inventory())  # MIG mode off: another inventory
    assert sorted(d.name for d in gate.devices()) == sorted(d.name for d in dra_devices(node.inventory.current))


async def test_counter_sets_come_first_in_slices_of_their_own() -> None:
    node = await _mig_node()
    desired = _desired(node, _gate(node, "dynamic-mig"))
    counters = [s for s in desired if isinstance(s, CounterSlice)]
    devices = [s for s in desired if not isinstance(s, CounterSlice)]
    assert desired[: len(counters)] == tuple(counters)  # counters first
    assert [len(s.sets) for s in counters] == [8]  # 8 GPUs, at most 8 sets per slice
    # 8 GPUs x (the whole GPU + 25 placements) = 208 devices, at most 64 per slice with counters
    assert [len(s) for s in devices] == [64, 64, 64, 16]  # type: ignore[arg-type]
    consumed = {u.counter_set for s in devices for d in s for u in d.consumes}  # type: ignore[union-attr]
    assert consumed == {c.name for s in counters for c in s.sets}


def test_nine_gpus_need_two_counter_slices() -> None:
    sets = [CounterSet(f"gpu-{i}-counters", (("memory-slice-0", "1"),)) for i in range(9)]
    assert [len(s.sets) for s in split((), sets) if isinstance(s, CounterSlice)] == [8, 1]


async def test_a_counter_set_nothing_consumes_is_not_published() -> None:
    node = await _mig_node()
    node.own(node.ownership.current.owner_of(node.inventory.current.gpus[0].uuid), **{"1": "device-plugin"})  # type: ignore[arg-type]
    desired = _desired(node, _gate(node, "dynamic-mig"))
    names = {c.name for s in desired if isinstance(s, CounterSlice) for c in s.sets}
    assert "gpu-1-counters" not in names and "gpu-0-counters" in names


@pytest.mark.parametrize("version", ["v1", "v1beta2"])
async def test_counter_and_shared_slices_round_trip_through_json(version: str) -> None:
    node = await _mig_node()
    gate = _gate(node, {"default": "dynamic-mig", "nodes": [{"match": {"names": [NODE]}, "gpus": {"0": "shared"}}]})
    node.inventory.update(mig_capable(await _inventory(), indexes=range(1, 8)))  # GPU 0 not in MIG mode
    shared = next(d for d in gate.devices() if d.share is not None)
    partition = next(d for d in gate.devices() if d.partition is not None and d.is_mig)
    for content in (CounterSlice(tuple(gate.counter_sets())), (SliceDevice.of(shared), SliceDevice.of(partition))):
        body = slice_body(
            version, node=NODE, node_uid="u", driver=DRIVER, generation=1, count=2, devices=content, name="s"
        )
        assert ("sharedCounters" in body["spec"]) != ("devices" in body["spec"])  # never both
        assert parse_slice(body, version).content == content


def test_plan_pairs_counter_slices_with_counter_slices() -> None:
    counters = CounterSlice((CounterSet("gpu-0-counters", (("memory-slice-0", "1"),)),))
    devices = (SliceDevice("gpu-0"),)

    def stored(name: str, content: object) -> StoredSlice:
        is_counters = isinstance(content, CounterSlice)
        return StoredSlice(
            name=name,
            uid=name,
            resource_version="1",
            driver=DRIVER,
            pool=NODE,
            generation=1,
            count=2,
            node_name=NODE,
            devices=() if is_counters else content,  # type: ignore[arg-type]
            owner_uid="n",
            counters=content.sets if isinstance(content, CounterSlice) else (),
        )

    both = [stored("a", counters), stored("b", devices)]
    assert plan((counters, devices), both, node=NODE, driver=DRIVER, node_uid="n").empty
    changed = CounterSlice((CounterSet("gpu-0-counters", (("memory-slice-0", "1"), ("memory-slice-1", "1"))),))
    writes = plan((changed, devices), both, node=NODE, driver=DRIVER, node_uid="n")
    assert [(s.name, c) for s, c in writes.updates] == [("a", changed), ("b", devices)]
    assert writes.reasons[0] == "counters of a differ"


# --- the publisher against the fake API server --------------------------------------------


def _counter_slices(api: FakeApiServer) -> list[dict[str, object]]:
    return [s for s in api.slices_of() if s["spec"].get("sharedCounters")]


async def test_dynamic_mig_publishes_counters_and_partitions(tmp_path: Path) -> None:
    node = await _mig_node()
    gate = _gate(node, "dynamic-mig")
    async with serving() as api, publishing(api, tmp_path, node, gate=gate) as publisher:
        await until(lambda: publisher.readiness().ok and len(api.slices_of()) == 5, "published")
        assert gate.support.counters is True
        (counters,) = _counter_slices(api)
        assert len(counters["spec"]["sharedCounters"]) == 8  # type: ignore[index]
        pools = {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in api.slices_of()}
        assert pools == {(1, 5)}
        assert all(s["spec"]["nodeName"] == NODE for s in api.slices_of())  # the counter slice too
        assert publisher.debug_state()["counters_supported"] is True


async def test_shared_gpus_publish_one_multi_allocatable_device_each(tmp_path: Path) -> None:
    node = _node(await _inventory())
    gate = _gate(node, "shared")
    async with serving() as api, publishing(api, tmp_path, node, gate=gate) as publisher:
        names = [d.name for d in gate.devices()]
        await until(lambda: publisher.readiness().ok and api.slices_of() != [], "published")
        (stored,) = api.slices_of()
        devices = stored["spec"]["devices"]
        assert [d["name"] for d in devices] == names == [f"gpu-{i}-shared" for i in range(8)]
        assert devices[0]["allowMultipleAllocations"] is True
        assert devices[0]["capacity"]["memory"] == {
            "value": "81559Mi",
            "requestPolicy": {"default": "8Gi", "validRange": {"min": "1Gi", "step": "1Gi"}},
        }
        assert devices[0]["attributes"]["sharing"] == {"string": "time-sliced"}
        assert devices[0]["attributes"]["memoryIsolation"] == {"string": "none"}


@pytest.mark.parametrize(
    ("api_kwargs", "publish", "why"),
    [
        ({"partitionable": False}, "dynamic-mig", "drops device counters"),
        ({"consumable": False}, "shared", "drops shared devices"),
        ({"versions": ("v1beta1",)}, "dynamic-mig", "v1beta1"),
        ({"versions": ("v1beta1",)}, "shared", "v1beta1"),
    ],
    ids=["partitionable-off", "consumable-off", "v1beta1-mig", "v1beta1-shared"],
)
async def test_a_server_that_drops_the_fields_gets_whole_gpus_and_says_why(
    tmp_path: Path, api_kwargs: dict[str, object], publish: str, why: str
) -> None:
    node = await _mig_node() if publish == "dynamic-mig" else _node(await _inventory())
    gate = _gate(node, publish)
    async with serving(**api_kwargs) as api, publishing(api, tmp_path, node, gate=gate) as publisher:
        await until(lambda: all(m.effective and m.effective.value == "whole" for m in gate.modes().values()), "whole")
        await until(lambda: publisher.readiness().ok, "published")
        names = sorted(d["name"] for s in api.slices_of() for d in s["spec"].get("devices") or ())
        # dynamic-mig on MIG-mode GPUs falls back to whole: their (absent) MIG devices; shared: gpu-<i>
        assert names == sorted(d.name for d in dra_devices(node.inventory.current))
        assert not _counter_slices(api)
        mode = next(iter(gate.modes().values()))
        assert why in mode.note and "published whole" in mode.note
        assert why in str(publisher.debug_state()["support_note"])


async def test_fields_dropped_after_the_probe_fall_back_loudly(tmp_path: Path) -> None:
    node = await _mig_node()
    gate = _gate(node, "dynamic-mig")
    async with serving() as api, publishing(api, tmp_path, node, gate=gate) as publisher:
        await until(lambda: publisher.readiness().ok and len(api.slices_of()) == 5, "published")
        api.partitionable = False  # the gate switched off under a running agent
        publisher.resync()
        node.own(Owner.DRA, **{"7": Owner.DEVICE_PLUGIN})  # forces a write
        await until(lambda: gate.support.counters is False, "noticed")
        await until(lambda: not _counter_slices(api) and publisher.readiness().ok, "whole again")
