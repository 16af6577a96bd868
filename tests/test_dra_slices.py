"""The pure side of ResourceSlice publishing: pool contents, splitting, planning, names, JSON shapes."""

from __future__ import annotations

import dataclasses
import re

import pytest

from agent.backends.simulated import SimulatedBackend
from agent.core.config.schema import HealthConfig
from agent.dra.devices import DraDevice, dra_devices
from agent.dra.slices.codec import parse_slice, slice_body
from agent.dra.slices.plan import (
    MAX_DEVICES,
    MAX_DEVICES_WITH_TAINTS,
    Plan,
    SliceDevice,
    StoredSlice,
    Taint,
    generate_name,
    label_value,
    plan,
    pool_devices,
    split,
)

DRIVER = "gpu-node-agent.nvidia.com"
NODE = "node-a"


async def _devices(preset: str = "h100-8x-nvlink") -> list[DraDevice]:
    return dra_devices(await SimulatedBackend(preset=preset, node_name=NODE, health=HealthConfig()).load())


def _stored(name: str, devices: tuple[SliceDevice, ...], generation: int = 1, count: int = 1) -> StoredSlice:
    return StoredSlice(
        name=name,
        uid=f"uid-{name}",
        resource_version="7",
        driver=DRIVER,
        pool=NODE,
        generation=generation,
        count=count,
        node_name=NODE,
        devices=devices,
        owner_uid="node-uid",
    )


def _plan(desired: tuple[tuple[SliceDevice, ...], ...], stored: list[StoredSlice], last: int = 0) -> Plan:
    return plan(desired, stored, node=NODE, driver=DRIVER, node_uid="node-uid", last_generation=last)


async def test_pool_has_granted_devices_and_unhealthy_ones_leave_or_are_tainted() -> None:
    devices = await _devices()
    granted = {d.gpu_uuid for d in devices[:4]}
    sick = devices[1].uuid

    def cause(uuid: str) -> str | None:
        return "Xid 79: GPU has fallen off the bus" if uuid == sick else None

    without = pool_devices(devices, granted=granted.__contains__, unhealthy_cause=cause, driver=DRIVER, taints=False)
    assert [d.name for d in without] == [devices[0].name, devices[2].name, devices[3].name]
    tainted = pool_devices(devices, granted=granted.__contains__, unhealthy_cause=cause, driver=DRIVER, taints=True)
    assert [d.name for d in tainted] == [d.name for d in devices[:4]]
    assert tainted[1].taints == (Taint(f"{DRIVER}/unhealthy", "Xid-79-GPU-has-fallen-off-the-bus", "NoSchedule"),)
    assert not any(d.taints for i, d in enumerate(tainted) if i != 1)
    assert tainted[0].gpu_uuid == devices[0].gpu_uuid


async def test_mig_devices_name_their_parent_gpu() -> None:
    devices = await _devices("a100-4x-mig")
    mig = next(d for d in devices if d.is_mig)
    assert SliceDevice.of(mig).gpu_uuid == mig.gpu_uuid != mig.uuid


def _synthetic(n: int) -> tuple[SliceDevice, ...]:
    return tuple(SliceDevice(f"gpu-{i}", (("uuid", "string", f"GPU-{i}"),)) for i in range(n))


@pytest.mark.parametrize(("n", "sizes"), [(0, []), (1, [1]), (128, [128]), (129, [128, 1]), (300, [128, 128, 44])])
def test_split_at_128(n: int, sizes: list[int]) -> None:
    assert [len(s) for s in split(_synthetic(n))] == sizes


def test_split_at_64_when_a_device_is_tainted() -> None:
    devices = list(_synthetic(130))
    devices[5] = SliceDevice(devices[5].name, devices[5].attributes, taints=(Taint("d/unhealthy", "x"),))
    assert [len(s) for s in split(devices)] == [64, 64, 2]
    assert MAX_DEVICES == 128 and MAX_DEVICES_WITH_TAINTS == 64


def test_plan_is_empty_when_the_stored_pool_agrees() -> None:
    desired = split(_synthetic(3))
    current = _plan(desired, [_stored("s-a", desired[0], generation=4)], last=4)
    assert current.empty and current.generation == 4


def test_plan_bumps_the_generation_and_rewrites_every_slice_on_a_change() -> None:
    desired = split(_synthetic(200))
    stored = [_stored("s-a", desired[0], 3, 2), _stored("s-b", desired[1][:-1], 3, 2)]
    current = _plan(desired, stored, last=3)
    assert current.generation == 4 and current.count == 2
    assert [(s.name, len(d)) for s, d in current.updates] == [("s-a", 128), ("s-b", 72)]
    assert not current.creates and not current.deletes


def test_plan_recreates_missing_slices_and_deletes_older_generations_and_strays() -> None:
    desired = split(_synthetic(200))
    stored = [_stored("s-old", desired[0], generation=2), _stored("s-a", desired[0], 5, 2)]
    current = _plan(desired, stored, last=5)
    assert current.generation == 6
    assert [s.name for s, _ in current.updates] == ["s-a"]
    assert [len(d) for d in current.creates] == [72]
    assert [s.name for s in current.deletes] == ["s-old"]
    # after the kubelet deleted everything, the generation still moves up from what we wrote last
    assert _plan(desired, [], last=6).generation == 7


def test_plan_for_an_empty_pool_deletes_everything() -> None:
    stored = [_stored("s-a", _synthetic(2), generation=3)]
    current = _plan((), stored, last=3)
    assert [s.name for s in current.deletes] == ["s-a"] and not current.updates and not current.creates
    assert _plan((), []).empty


def test_plan_notices_pool_field_drift() -> None:
    desired = split(_synthetic(2))
    stored = _stored("s-a", desired[0])
    assert _plan(desired, [stored]).empty
    for change in ({"owner_uid": "other"}, {"count": 2}, {"node_name": "elsewhere"}):
        assert not _plan(desired, [dataclasses.replace(stored, **change)]).empty, change  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("node", "expected"),
    [
        ("node-a", f"node-a-{DRIVER}-"),
        ("n" * 40 + ".example.com", ("n" * 40 + ".example.com-" + DRIVER)[:57].rstrip(".-") + "-"),
        ("a" * 56 + ".b", "a" * 56 + "-"),  # the cut falls after the dot: no label may end in '.' or '-'
    ],
)
def test_generate_name_fits_the_servers_prefix(node: str, expected: str) -> None:
    name = generate_name(node, DRIVER)
    assert name == expected and len(name) <= 58
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?-", name)
    assert ".-" not in name and "-." not in name[:-1]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("Xid 79: GPU has fallen off the bus", "Xid-79-GPU-has-fallen-off-the-bus"),
        ("health unknown", "health-unknown"),
        ("  !!!  ", "unknown"),
        ("x" * 100, "x" * 63),
        ("-a.b_", "a.b"),
    ],
)
def test_label_value(text: str, value: str) -> None:
    assert label_value(text) == value
    assert re.fullmatch(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?", value) and len(value) <= 63


@pytest.mark.parametrize("version", ["v1", "v1beta2", "v1beta1"])
async def test_slice_json_round_trips_in_each_version(version: str) -> None:
    device = SliceDevice.of((await _devices())[0], (Taint(f"{DRIVER}/unhealthy", "x"),))
    body = slice_body(
        version,
        node=NODE,
        node_uid="node-uid",
        driver=DRIVER,
        generation=3,
        count=1,
        devices=(device,),
        generate_name="p-",
    )
    raw = body["spec"]["devices"][0]
    if version == "v1beta1":
        assert set(raw) == {"name", "basic"} and {"attributes", "capacity", "taints"} <= set(raw["basic"])
    else:
        assert "basic" not in raw and raw["capacity"]["memory"] == {"value": "81559Mi"}
    assert body["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "node-uid", "controller": True}
    ]
    body["metadata"].update(name="p-abcde", uid="u", resourceVersion="9")
    target = raw["basic"] if version == "v1beta1" else raw
    target["taints"][0]["timeAdded"] = "2026-01-01T00:00:00Z"  # the server adds it; it is no difference
    stored = parse_slice(body, version)
    assert stored.devices == (device,) and stored.generation == 3 and stored.count == 1
    assert stored.owner_uid == "node-uid" and stored.gpus == {device.gpu_uuid}


def test_parse_slice_refuses_what_is_not_a_slice() -> None:
    with pytest.raises(ValueError):
        parse_slice({"metadata": {}}, "v1")
    with pytest.raises(ValueError):
        parse_slice({"metadata": {"name": "x"}, "spec": {"devices": {"a": 1}}}, "v1")
    odd = parse_slice(
        {
            "metadata": {"name": "x"},
            "spec": {"devices": [{"name": "d", "attributes": {"a": {"int": 1, "bool": True}}}]},
        },
        "v1",
    )
    assert odd.devices[0].attributes == (("a", "int", 1),) and odd.generation == -1
