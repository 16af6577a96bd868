"""The fake API server is as strict as a real v1.36 kube-apiserver where the agent depends on it:
each row of the reference's "Observed" table is rejected with the real wording."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from agent.kube.access import kubeconfig_access
from agent.kube.client import KubeClient
from agent.kube.errors import KubeError
from tests.fake_apiserver import NODE, FakeApiServer, serving, write_kubeconfig

V1 = "/apis/resource.k8s.io/v1/resourceslices"
V1BETA1 = "/apis/resource.k8s.io/v1beta1/resourceslices"


def _good() -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "s1"},
        "spec": {
            "driver": "gpu.example.com",
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": 0, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "gpu-0",
                    "attributes": {"uuid": {"string": "GPU-1"}, "driverVersion": {"version": "570.1.2"}},
                    "capacity": {"memory": {"value": "80Gi"}},
                }
            ],
        },
    }


def _attrs(n: int) -> dict[str, Any]:
    return {f"a{i}": {"int": i} for i in range(n)}


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target: Any = obj
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        target[last] = value

    return change


_MULTIPLE = "exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection is required, but multiple"
_TOO_MANY = "spec.devices: Too many: 200: must have at most 128 items"
OBSERVED = [
    (_set("spec.devices", [{"name": f"gpu-{i}"} for i in range(200)]), _TOO_MANY),
    (_set("spec.devices.0.name", "GPU_0"), 'name: Invalid value: "GPU_0": a lowercase RFC 1123 label must consist of'),
    (_set("spec.devices.0.name", "gpu-0.a"), "must not contain dots"),
    (_set("spec.devices", [{"name": "gpu-0"}, {"name": "gpu-0"}]), 'spec.devices[1]: Duplicate value: "gpu-0"'),
    (_set("spec.driver", "Not_A_Driver"), 'spec.driver: Invalid value: "Not_A_Driver": a lowercase RFC 1123 subdomain'),
    (_set("spec.pool.name", ""), "spec.pool.name: Required value"),
    (_set("spec.pool.resourceSliceCount", 0), "must be greater than zero"),
    (_set("spec.pool.generation", -1), "must be greater than or equal to zero"),
    (_set("spec.allNodes", True), _MULTIPLE),
    (_set("spec.devices.0.attributes", {"bad attr name!": {"int": 1}}), "a valid C identifier must start with"),
    (_set("spec.devices.0.attributes", {"s": {"string": "x" * 65}}), "string: Too long: may not be more than 64 bytes"),
    (_set("spec.devices.0.attributes", {"s": {}}), "exactly one value must be specified"),
    (_set("spec.devices.0.attributes", {"s": {"int": 1, "bool": True}}), "exactly one value must be specified"),
    (_set("spec.devices.0.attributes", {"v": {"version": "not-a-semver"}}), "compatible with semver.org spec 2.0.0"),
    (_set("spec.devices.0.attributes", _attrs(41)), "the total number of attributes and capacities must not exceed 32"),
]


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    async with serving(versions=("v1", "v1beta1")) as fake:
        yield fake


@pytest.fixture
async def client(api: FakeApiServer, tmp_path: Path) -> AsyncIterator[KubeClient]:
    async with KubeClient(kubeconfig_access(write_kubeconfig(tmp_path, api.url))) as kube:
        yield kube


@pytest.mark.parametrize(("change", "message"), OBSERVED)
async def test_rejected_like_a_real_apiserver(client: KubeClient, change: Any, message: str) -> None:
    body = _good()
    change(body)
    with pytest.raises(KubeError) as err:
        await client.create(V1, body)
    assert err.value.status == 422 and message in str(err.value)
    assert 'ResourceSlice.resource.k8s.io "s1" is invalid: ' in str(err.value)


async def test_accepted_like_a_real_apiserver(client: KubeClient, api: FakeApiServer) -> None:
    body = _good()
    body["spec"]["devices"][0]["capacity"]["neg"] = {"value": "-1Gi"}
    await client.create(V1, body)
    empty = _good()
    empty["metadata"]["name"] = "s2"
    empty["spec"]["devices"] = []
    await client.create(V1, empty)
    assert len(api.slices) == 2


async def test_immutable_fields(client: KubeClient) -> None:
    stored = await client.create(V1, _good())
    for field, value in (("driver", "other.example.com"), ("nodeName", "elsewhere")):
        changed = copy.deepcopy(stored)
        changed["spec"][field] = value
        with pytest.raises(KubeError, match=rf"spec.{field}: Invalid value: .*field is immutable"):
            await client.replace(f"{V1}/s1", changed)
    changed = copy.deepcopy(stored)
    changed["spec"]["pool"]["name"] = "other"
    with pytest.raises(KubeError, match=r"spec.pool.name: Invalid value: .*field is immutable"):
        await client.replace(f"{V1}/s1", changed)


async def test_v1beta1_shape_is_converted_both_ways(client: KubeClient, api: FakeApiServer) -> None:
    body = _good()
    device = body["spec"]["devices"][0]
    body["spec"]["devices"][0] = {"name": device["name"], "basic": {"attributes": device["attributes"]}}
    body["apiVersion"] = "resource.k8s.io/v1beta1"
    await client.create(V1BETA1, body)
    assert api.slices["s1"]["spec"]["devices"][0]["attributes"]["uuid"] == {"string": "GPU-1"}
    v1 = await client.get(f"{V1}/s1")
    assert "basic" not in v1["spec"]["devices"][0]
    beta = await client.get(f"{V1BETA1}/s1")
    assert beta["spec"]["devices"][0]["basic"]["attributes"]["uuid"] == {"string": "GPU-1"}


async def test_field_selectors_and_taint_gate(client: KubeClient, api: FakeApiServer) -> None:
    body = _good()
    body["spec"]["devices"][0]["taints"] = [{"key": "d.example.com/x", "value": "y", "effect": "NoSchedule"}]
    stored = await client.create(V1, body)
    assert stored["spec"]["devices"][0]["taints"][0]["timeAdded"]
    other = _good()
    other["metadata"]["name"] = "s2"
    other["spec"]["nodeName"] = "other-node"
    other["spec"]["pool"]["name"] = "other-node"
    api.taints = False
    stored = await client.create(V1, other)
    assert "taints" not in stored["spec"]["devices"][0]  # silently dropped, as with the gate off
    mine = await client.list(V1, {"fieldSelector": f"spec.nodeName={NODE},spec.driver=gpu.example.com"})
    assert [s["metadata"]["name"] for s in mine["items"]] == ["s1"]
    with pytest.raises(KubeError, match=r"field label not supported: spec\.pool\.name"):
        await client.list(V1, {"fieldSelector": "spec.pool.name=x"})
