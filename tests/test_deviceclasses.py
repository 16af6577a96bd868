"""The DeviceClasses under config/ compile as Kubernetes CEL and select the right devices.

DEVICES is a hand-written fleet in the published shape (attributes under the driver's domain,
the NVIDIA DRA driver's vocabulary, capacity ``memory``) with an H200 and another driver's GPU;
:func:`test_classes_select_from_what_the_publisher_really_writes` runs the classes against the
publisher's own slices for every simulated preset, in v1 and v1beta1 shape.
"""

from __future__ import annotations

from typing import Any

import pytest

from agent.core.config.schema import DEFAULT_DRA_DRIVER
from tests.cel_eval import (
    CelCompileError,
    CelEvaluationError,
    Quantity,
    Semver,
    class_selectors,
    compile_expression,
    devices_from_resource_slice,
    matches,
    select,
)
from tests.manifests import KUSTOMIZATIONS, render

DOMAIN = DEFAULT_DRA_DRIVER


def _gpu(name: str, product: str, memory: str, *, minor: int, arch: str, cc: str, bus: str) -> dict[str, Any]:
    return {
        "name": name,
        "driver": DOMAIN,
        "attributes": {
            DOMAIN: {
                "type": "gpu",
                "uuid": f"GPU-{minor:08d}-0000-0000-0000-000000000000",
                "index": {"int": minor},
                "minor": {"int": minor},
                "productName": product,
                "brand": "Nvidia",
                "architecture": arch,
                "cudaComputeCapability": {"version": cc},
                "driverVersion": {"version": "570.124.6"},
                "cudaDriverVersion": {"version": "12.8.0"},
                "pcieBusID": bus,
            },
            "resource.kubernetes.io": {"pcieRoot": f"pci0000:{bus[5:7].lower()}"},
        },
        "capacity": {DOMAIN: {"memory": memory}},
    }


def _mig(parent: dict[str, Any], gi: int, profile: str, memory: str) -> dict[str, Any]:
    device = _gpu(
        f"{parent['name']}-mig-{gi}-0",
        parent["attributes"][DOMAIN]["productName"],
        memory,
        minor=parent["attributes"][DOMAIN]["minor"]["int"],
        arch=parent["attributes"][DOMAIN]["architecture"],
        cc=parent["attributes"][DOMAIN]["cudaComputeCapability"]["version"],
        bus=parent["attributes"][DOMAIN]["pcieBusID"],
    )
    device["attributes"][DOMAIN].update(
        {"type": "mig", "uuid": f"MIG-{gi:08d}", "parentUUID": parent["attributes"][DOMAIN]["uuid"], "profile": profile}
    )
    return device


H100 = [
    _gpu(f"gpu-{i}", "NVIDIA H100 80GB HBM3", "81559Mi", minor=i, arch="Hopper", cc="9.0.0", bus=bus)
    for i, bus in enumerate(["00000000:18:00.0", "00000000:2A:00.0"])
]
A100_MIG_PARENT = _gpu(
    "gpu-2", "NVIDIA A100-SXM4-40GB", "40960Mi", minor=2, arch="Ampere", cc="8.0.0", bus="00000000:07:00.0"
)
A100_MIG = [
    _mig(A100_MIG_PARENT, 1, "1g.5gb", "4864Mi"),
    _mig(A100_MIG_PARENT, 2, "1g.5gb", "4864Mi"),
    _mig(A100_MIG_PARENT, 3, "3g.20gb", "20096Mi"),
]
A100 = _gpu("gpu-3", "NVIDIA A100-SXM4-40GB", "40960Mi", minor=3, arch="Ampere", cc="8.0.0", bus="00000000:4E:00.0")
RTX = _gpu(
    "gpu-4",
    "NVIDIA RTX 6000 Ada Generation",
    "49140Mi",
    minor=4,
    arch="Ada Lovelace",
    cc="8.9.0",
    bus="00000000:3B:00.0",
)
H200 = _gpu("gpu-5", "NVIDIA H200", "143771Mi", minor=5, arch="Hopper", cc="9.0.0", bus="00000000:9A:00.0")
OTHER_DRIVER = {
    **_gpu("gpu-0", "NVIDIA H100 80GB HBM3", "81559Mi", minor=0, arch="Hopper", cc="9.0.0", bus="00000000:AB:00.0")
}
OTHER_DRIVER = {
    **OTHER_DRIVER,
    "driver": "gpu.nvidia.com",
    "attributes": {"gpu.nvidia.com": OTHER_DRIVER["attributes"][DOMAIN]},
    "capacity": {"gpu.nvidia.com": OTHER_DRIVER["capacity"][DOMAIN]},
}


def _partition(parent: dict[str, Any], profile: str, start: int, memory: str) -> dict[str, Any]:
    """A dynamic-mig partition: a MIG profile placement, no UUID until it is made."""
    device = _mig(parent, 0, profile, memory)
    device["name"] = f"{parent['name']}-mig-{profile.replace('.', '')}-19-{start}"
    del device["attributes"][DOMAIN]["uuid"]
    return device


def _shared(parent: dict[str, Any]) -> dict[str, Any]:
    device = {**parent, "name": f"{parent['name']}-shared", "attributes": {**parent["attributes"]}}
    device["attributes"][DOMAIN] = {**parent["attributes"][DOMAIN], "type": "shared", "sharing": "time-sliced"}
    return device


H100_PARTITIONED = _gpu(
    "gpu-6", "NVIDIA H100 80GB HBM3", "81559Mi", minor=6, arch="Hopper", cc="9.0.0", bus="00000000:9B:00.0"
)
PARTITIONS = [
    _partition(H100_PARTITIONED, "1g.10gb", 0, "9984Mi"),
    _partition(H100_PARTITIONED, "3g.40gb", 4, "40448Mi"),
]
SHARED = _shared(
    _gpu("gpu-7", "NVIDIA H100 80GB HBM3", "81559Mi", minor=7, arch="Hopper", cc="9.0.0", bus="00000000:9C:00.0")
)
DEVICES = [*H100, *A100_MIG, A100, RTX, H200, H100_PARTITIONED, *PARTITIONS, SHARED, OTHER_DRIVER]
WHOLE_GPUS = ["gpu-0", "gpu-1", "gpu-3", "gpu-4", "gpu-5", "gpu-6"]

#: DeviceClass name -> the devices (by name, of our driver) it must select, exactly
EXPECTED = {
    "gpu.gpu-node-agent.nvidia.com": WHOLE_GPUS,
    "gpu-extended-resource.gpu-node-agent.nvidia.com": WHOLE_GPUS,
    "gpu-80gb.gpu-node-agent.nvidia.com": ["gpu-0", "gpu-1", "gpu-5", "gpu-6"],
    "h100-80gb-hbm3.gpu-node-agent.nvidia.com": ["gpu-0", "gpu-1", "gpu-6"],
    "mig-1g.5gb.gpu-node-agent.nvidia.com": ["gpu-2-mig-1-0", "gpu-2-mig-2-0"],
    "mig-1g.10gb.gpu-node-agent.nvidia.com": ["gpu-6-mig-1g10gb-19-0"],
    "mig-3g.40gb.gpu-node-agent.nvidia.com": ["gpu-6-mig-3g40gb-19-4"],
    "shared-gpu.gpu-node-agent.nvidia.com": ["gpu-7-shared"],
}


def _device_classes() -> dict[str, dict[str, Any]]:
    classes = {}
    for directory in KUSTOMIZATIONS:
        for obj in render(directory):
            if obj["kind"] == "DeviceClass":
                classes[obj["metadata"]["name"]] = obj
    return classes


def test_every_shipped_device_class_has_an_expectation() -> None:
    assert sorted(_device_classes()) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_selectors_compile(name: str) -> None:
    selectors = class_selectors(_device_classes()[name])
    assert selectors
    for selector in selectors:
        # attributes are read under the agent's domain only, never by device name
        assert f'device.driver == "{DOMAIN}"' in selector.source
        assert "device.name" not in selector.source


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_class_selects_exactly_the_intended_devices(name: str) -> None:
    # select() raises if a selector errors on any device (the scheduler would abort the attempt)
    chosen = select(_device_classes()[name], DEVICES)
    assert [d["name"] for d in chosen] == EXPECTED[name]
    assert all(d["driver"] == DOMAIN for d in chosen)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_class_selects_the_same_from_a_published_resource_slice(name: str) -> None:
    ours = [d for d in DEVICES if d["driver"] == DOMAIN]
    resource_slice = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "spec": {
            "driver": DOMAIN,
            "nodeName": "gpu-node-1",
            "pool": {"name": "gpu-node-1", "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": d["name"],
                    "attributes": {
                        **{k: v if isinstance(v, dict) else {"string": v} for k, v in d["attributes"][DOMAIN].items()},
                        "resource.kubernetes.io/pcieRoot": {
                            "string": d["attributes"]["resource.kubernetes.io"]["pcieRoot"]
                        },
                    },
                    "capacity": {"memory": {"value": d["capacity"][DOMAIN]["memory"]}},
                }
                for d in ours
            ],
        },
    }
    published = devices_from_resource_slice(resource_slice)
    assert [d["name"] for d in select(_device_classes()[name], published)] == EXPECTED[name]


def test_80_gib_would_miss_every_h100_80gb() -> None:
    # why gpu-80gb compares with quantity("80G"): NVML reports 81559 MiB for an H100 80GB
    binary = compile_expression(f'device.capacity["{DOMAIN}"].memory.compareTo(quantity("80Gi")) >= 0')
    assert not any(matches(binary, d) for d in H100)


def test_an_unguarded_missing_attribute_is_an_error_not_a_mismatch() -> None:
    # as in the scheduler: reading an attribute a device lacks fails the evaluation
    with pytest.raises(CelEvaluationError, match="profile"):
        matches(f'device.attributes["{DOMAIN}"].profile == "1g.5gb"', H100[0])
    # an unknown domain is an empty map, not an error
    assert matches('device.attributes["example.com"].size() == 0', H100[0])


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        (f'device.capacity["{DOMAIN}"].memory.compareto(quantity("1"))', "undeclared functions"),
        ('devices.driver == "x"', "undeclared variables"),
        ("device.driver ==", "does not parse"),
        ("true || " * 1500 + "true", "over 10240"),
    ],
)
def test_compile_rejects_what_kubernetes_rejects(expression: str, message: str) -> None:
    with pytest.raises(CelCompileError, match=message):
        compile_expression(expression)


def test_non_boolean_selector_is_an_error() -> None:
    with pytest.raises(CelEvaluationError, match="not a bool"):
        matches("device.driver", H100[0])


@pytest.mark.parametrize(
    ("a", "b", "order"),
    [("80Gi", "85899345920", 0), ("81559Mi", "80G", 1), ("1.5G", "1500M", 0), ("500m", "1", -1), ("2e3", "2k", 0)],
)
def test_quantity_order(a: str, b: str, order: int) -> None:
    left, right = Quantity.parse(a), Quantity.parse(b)
    assert (left > right) - (left < right) == order


@pytest.mark.parametrize(
    ("a", "b", "order"),
    [
        ("9.0.0", "8.9.0", 1),
        ("1.0.0-alpha", "1.0.0", -1),
        ("1.0.0-alpha.1", "1.0.0-alpha.beta", -1),
        ("1.2.3+b", "1.2.3", 0),
    ],
)
def test_semver_order(a: str, b: str, order: int) -> None:
    left, right = Semver.parse(a), Semver.parse(b)
    assert (left > right) - (left < right) == order


def test_versions_compare_in_cel() -> None:
    expression = f'device.attributes["{DOMAIN}"].cudaComputeCapability.isGreaterThan(semver("8.9.0"))'
    assert [d["name"] for d in DEVICES if d["driver"] == DOMAIN and matches(expression, d)] == [
        "gpu-0",
        "gpu-1",
        "gpu-5",
        "gpu-6",
        "gpu-6-mig-1g10gb-19-0",
        "gpu-6-mig-3g40gb-19-4",
        "gpu-7-shared",
    ]


@pytest.mark.parametrize("text", ["570.124.06", "12.8", "v1.0.0"])
def test_invalid_semver_is_refused(text: str) -> None:
    # NVML's driver version 570.124.06 has a leading zero: it must be published as 570.124.6
    with pytest.raises(ValueError, match="not a semantic version"):
        Semver.parse(text)


def _published(preset: str, version: str = "v1", publish: object = "whole") -> list[dict[str, Any]]:
    """What the agent's publisher writes for a simulated preset, every GPU given to DRA and
    published as ``publish`` says (``dra.publish``)."""
    import asyncio

    from agent.backends.simulated import SimulatedBackend
    from agent.core.config.loader import build_config
    from agent.core.config.schema import HealthConfig
    from agent.core.inventory.current import InventoryState
    from agent.core.ownership.publish import PublishState, compute_publish_modes
    from agent.dra.modes import ModeGate
    from agent.dra.slices.codec import slice_body
    from agent.dra.slices.plan import pool_devices, split

    inventory = asyncio.run(SimulatedBackend(preset=preset, node_name="n", health=HealthConfig()).load())
    config = build_config({"dra": {"publish": publish}})
    modes = compute_publish_modes(inventory, config.dra, node_name="n", node_labels={})
    gate = ModeGate(inventory=InventoryState(inventory), publish=PublishState(modes))
    devices = pool_devices(
        gate.devices(), granted=lambda _: True, unhealthy_cause=lambda _: None, driver=DOMAIN, taints=False
    )
    out: list[dict[str, Any]] = []
    for part in split(devices, gate.counter_sets()):
        body = slice_body(
            version, node="n", node_uid="u", driver=DOMAIN, generation=1, count=1, devices=part, generate_name="n-"
        )
        out.extend(devices_from_resource_slice(body))
    return out


PUBLISH_MODES = ["whole", "dynamic-mig", "shared"]


@pytest.mark.parametrize("publish", PUBLISH_MODES)
@pytest.mark.parametrize("version", ["v1", "v1beta1"])
@pytest.mark.parametrize("preset", ["h100-8x-nvlink", "a100-4x-mig", "workstation-2x-pcie"])
def test_classes_select_from_what_the_publisher_really_writes(preset: str, version: str, publish: str) -> None:
    """The classes against the publisher's own output for every simulated preset and publish mode;
    what each must select is worked out from the published attributes in plain Python, not by CEL."""
    if version == "v1beta1" and publish != "whole":
        pytest.skip("the agent never writes counters or shared devices as v1beta1 (its GPUs fall back to whole)")
    published = _published(preset, version, publish)
    assert published

    def attrs(d: dict[str, Any]) -> dict[str, Any]:
        """Attribute values without their type wrapper ({"string": "gpu"} -> "gpu")."""
        return {k: next(iter(v.values())) if isinstance(v, dict) else v for k, v in d["attributes"][DOMAIN].items()}

    def memory_bytes(d: dict[str, Any]) -> float:
        return float(Quantity.parse(str(d["capacity"][DOMAIN]["memory"])).value)

    whole = [d["name"] for d in published if attrs(d)["type"] == "gpu"]
    wanted = {
        "gpu.gpu-node-agent.nvidia.com": whole,
        "gpu-extended-resource.gpu-node-agent.nvidia.com": whole,
        "gpu-80gb.gpu-node-agent.nvidia.com": [
            d["name"] for d in published if attrs(d)["type"] == "gpu" and memory_bytes(d) >= 80e9
        ],
        "h100-80gb-hbm3.gpu-node-agent.nvidia.com": [
            d["name"]
            for d in published
            if attrs(d)["type"] == "gpu" and attrs(d)["productName"] == "NVIDIA H100 80GB HBM3"
        ],
        **{
            f"mig-{profile}.gpu-node-agent.nvidia.com": [
                d["name"] for d in published if attrs(d)["type"] == "mig" and attrs(d).get("profile") == profile
            ]
            for profile in ("1g.5gb", "1g.10gb", "3g.40gb")
        },
        "shared-gpu.gpu-node-agent.nvidia.com": [d["name"] for d in published if attrs(d)["type"] == "shared"],
    }
    for name, cls in _device_classes().items():
        assert [d["name"] for d in select(cls, published)] == wanted[name], name


def test_dynamic_mig_offers_seven_1g_10gb_per_h100_and_the_whole_gpus() -> None:
    """What the 56 x 1g.10gb check on eight H100s relies on: seven placements each, the whole GPU
    too (it takes every slice), nothing else selected by the whole-GPU class."""
    published = _published("h100-8x-nvlink", "v1", "dynamic-mig")
    classes = _device_classes()
    small = select(classes["mig-1g.10gb.gpu-node-agent.nvidia.com"], published)
    assert len(small) == 56 and {d["name"].rsplit("-", 1)[1] for d in small} == {str(i) for i in range(7)}
    assert [d["name"] for d in select(classes["gpu.gpu-node-agent.nvidia.com"], published)] == [
        f"gpu-{i}" for i in range(8)
    ]
    assert len(select(classes["mig-3g.40gb.gpu-node-agent.nvidia.com"], published)) == 16


def test_shared_gpus_are_only_selected_by_the_shared_class() -> None:
    published = _published("h100-8x-nvlink", "v1", "shared")
    classes = _device_classes()
    assert [d["name"] for d in select(classes["shared-gpu.gpu-node-agent.nvidia.com"], published)] == [
        f"gpu-{i}-shared" for i in range(8)
    ]
    assert select(classes["gpu.gpu-node-agent.nvidia.com"], published) == []
