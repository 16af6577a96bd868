"""ResourceClaims read through the real client from the fake API server, in each version's shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.kube.access import kubeconfig_access
from agent.kube.claims.decode import ClaimFormatError, parse_claim
from agent.kube.claims.model import ClaimRef, DeviceResult, OpaqueConfig, PodRef
from agent.kube.claims.source import KubeClaimSource
from agent.kube.client import KubeClient
from agent.kube.discovery import ResourceApi
from agent.kube.errors import KubeError
from tests.fake_apiserver import serving, write_kubeconfig

DRIVER = "gpu-node-agent.nvidia.com"
NS = "team-a"


def _claim(version: str, *, allocated: bool = True, **status: Any) -> dict[str, Any]:
    """A claim in ``version``'s shape: prioritized list in v1/v1beta2, flat request in v1beta1."""
    if version == "v1beta1":
        requests = [
            {"name": "gpus", "deviceClassName": "gpu"},
            {"name": "admin", "deviceClassName": "gpu", "adminAccess": True},
        ]
    else:
        requests = [
            {"name": "gpus", "firstAvailable": [{"name": "big", "deviceClassName": "gpu"}]},
            {"name": "admin", "exactly": {"deviceClassName": "gpu", "adminAccess": True}},
        ]
    claim: dict[str, Any] = {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceClaim",
        "metadata": {"namespace": NS, "name": "c1", "uid": "uid-1"},
        "spec": {"devices": {"requests": requests}},
        "status": {"reservedFor": [{"resource": "pods", "name": "p1", "uid": "pod-1"}], **status},
    }
    if allocated:
        claim["status"]["allocation"] = {
            "devices": {
                "results": [
                    {"request": "gpus/big", "driver": DRIVER, "pool": "n1", "device": "gpu-0", "shareID": "s-1"},
                    {"request": "admin", "driver": DRIVER, "pool": "n1", "device": "gpu-1"},
                    {"request": "gpus", "driver": "other.example.com", "pool": "n1", "device": "nic-0"},
                ],
                "config": [
                    {"source": "FromClass", "requests": [], "opaque": {"driver": DRIVER, "parameters": {"a": 1}}},
                    {
                        "source": "FromClaim",
                        "requests": ["gpus/big"],
                        "opaque": {"driver": DRIVER, "parameters": {"kind": "GpuConfig", "b": [1]}},
                    },
                    {"source": "FromClaim", "opaque": {"driver": "other.example.com", "parameters": {}}},
                ],
            },
            "allocationTimestamp": "2026-11-30T10:00:00Z",
        }
    return claim


@pytest.fixture
async def source_for(tmp_path: Path) -> AsyncIterator[Any]:
    clients: list[KubeClient] = []

    async def make(api: Any, **kwargs: Any) -> KubeClaimSource:
        client = KubeClient(kubeconfig_access(write_kubeconfig(tmp_path, api.url)))
        clients.append(client)
        return KubeClaimSource(client=client, **kwargs)

    yield make
    for client in clients:
        await client.close()


@pytest.mark.parametrize("version", ["v1", "v1beta2", "v1beta1"])
async def test_claim_in_each_version(version: str, source_for: Any) -> None:
    async with serving(versions=(version,)) as api:
        api.put_claim(_claim(version))
        claim = await (await source_for(api)).get_claim(ClaimRef(NS, "c1", "uid-1"))
    assert claim is not None and claim.allocated and claim.uid == "uid-1"
    assert claim.api_version == f"resource.k8s.io/{version}"
    first, second, other = claim.results
    assert first == DeviceResult("gpus/big", DRIVER, "n1", "gpu-0", share_id="s-1", admin_access=False)
    assert first.main_request == "gpus"
    # admin access comes from the spec when the result does not carry it
    assert second.admin_access is True and other.driver == "other.example.com"
    assert claim.configs[0] == OpaqueConfig("FromClass", DRIVER, (), {"a": 1})
    assert claim.configs[1].requests == ("gpus/big",) and claim.configs[1].parameters == {"kind": "GpuConfig", "b": [1]}
    assert claim.reserved_for == (PodRef("p1", "pod-1"),)
    assert claim.allocation_timestamp == "2026-11-30T10:00:00Z"


async def test_missing_not_allocated_and_recreated_claims(source_for: Any) -> None:
    async with serving() as api:
        source = await source_for(api)
        assert await source.get_claim(ClaimRef(NS, "nope", "u")) is None
        api.put_claim(_claim("v1", allocated=False))
        claim = await source.get_claim(ClaimRef(NS, "c1", "uid-1"))
        assert claim is not None and not claim.allocated and claim.results == ()
        recreated = _claim("v1")
        recreated["metadata"]["uid"] = "uid-2"
        api.put_claim(recreated)
        claim = await source.get_claim(ClaimRef(NS, "c1", "uid-1"))
        assert claim is not None and claim.uid == "uid-2"  # the caller compares UIDs


async def test_an_unreachable_api_gives_up_within_the_claim_timeout(source_for: Any) -> None:
    async with serving() as api:
        source = await source_for(api, timeout_s=0.2)
        await source.get_claim(ClaimRef(NS, "x", "u"))  # discovery done
        api.hang(times=None)
        with pytest.raises(KubeError, match=r"no answer within 0.2s") as err:
            await source.get_claim(ClaimRef(NS, "c1", "uid-1"))
    assert err.value.recoverable


async def test_a_version_that_went_away_is_rediscovered(source_for: Any, tmp_path: Path) -> None:
    async with serving(versions=("v1",)) as api:
        client = KubeClient(kubeconfig_access(write_kubeconfig(tmp_path, api.url)))
        try:
            resources = ResourceApi(client)
            source = KubeClaimSource(client=client, resource_api=resources)
            assert await source.get_claim(ClaimRef(NS, "c1", "u")) is None
            api.versions = ("v1beta1",)
            api.put_claim(_claim("v1beta1"))
            claim = await source.get_claim(ClaimRef(NS, "c1", "uid-1"))
            assert claim is not None and claim.api_version == "resource.k8s.io/v1beta1"
            assert resources.discoveries == 2
        finally:
            await client.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["status"]["allocation"]["devices"]["config"][0]["opaque"].update(parameters=[1]), "got list"),
        (lambda c: c["status"]["allocation"]["devices"]["config"][0]["opaque"].pop("parameters"), "got null"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0].update(device=7), "device: not a non-empty"),
        (lambda c: c["status"]["allocation"]["devices"].update(results={"a": 1}), "results: not a list"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0].update(adminAccess="yes"), "not a boolean"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0].update(shareID=5), "shareID"),
        (lambda c: c["status"].update(reservedFor=[{"uid": "x"}]), "reservedFor[0].name"),
        (lambda c: c["status"]["allocation"]["devices"].update(results=[{}] * 300), "too many"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0].update(consumedCapacity=[1]), "consumedCapacity"),
        (
            lambda c: c["status"]["allocation"]["devices"]["results"][0].update(consumedCapacity={"memory": 40}),
            "'memory' is not a quantity",
        ),
        (
            lambda c: c["status"]["allocation"]["devices"]["results"][0].update(
                consumedCapacity={f"c{i}": "1" for i in range(100)}
            ),
            "at most 64 quantities",
        ),
        (
            lambda c: c["status"]["allocation"]["devices"]["results"][0].update(consumedCapacity={"memory": "9" * 500}),
            "is not a quantity",
        ),
    ],
)
def test_malformed_claims_are_one_clear_per_claim_error(change: Any, message: str) -> None:
    raw = _claim("v1")
    change(raw)
    with pytest.raises(ClaimFormatError) as err:
        parse_claim(raw, api_version="resource.k8s.io/v1")
    text = str(err.value)
    assert message in text and text.startswith(f"ResourceClaim {NS}/c1: ") and not err.value.recoverable


def test_a_share_carries_its_share_id_and_consumed_capacity() -> None:
    raw = _claim("v1")
    raw["status"]["allocation"]["devices"]["results"][0].update(shareID="3f1c", consumedCapacity={"memory": "38Gi"})
    result = parse_claim(raw, api_version="resource.k8s.io/v1").results[0]
    assert result.share_id == "3f1c" and result.consumed == {"memory": "38Gi"}
