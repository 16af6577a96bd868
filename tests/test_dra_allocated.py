"""Claims the scheduler allocated on this node's devices and the kubelet has not had prepared yet:
found through the node's pods (the fake API server) and their claims, while a GPU drains away."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agent.core.config.schema import Owner
from agent.core.ownership.table import Drain, OwnershipState, OwnershipTable
from agent.dra.claims.allocated import AllocatedClaims
from agent.kube.access import kubeconfig_access
from agent.kube.client import KubeClient
from agent.kube.errors import KubeError
from agent.kube.podclaims import NodePodClaims, PodClaims
from tests.dra_fakes import DRIVER, FakeClaimSource, result
from tests.fake_apiserver import NODE, FakeApiServer, serving, write_kubeconfig


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    async with serving() as fake:
        yield fake


def bound(api: FakeApiServer, name: str, *, node: str = NODE, phase: str = "Running", **status: Any) -> dict[str, Any]:
    pod = api.add_pod("ml", name, node=node)
    pod["status"] = {"phase": phase, **status}
    return pod


async def test_the_claims_of_the_nodes_unfinished_pods_are_listed(api: FakeApiServer, tmp_path: Path) -> None:
    named = bound(api, "named")
    named["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "shared-gpu"}]
    bound(api, "templated", resourceClaimStatuses=[{"name": "gpu", "resourceClaimName": "templated-gpu-x7k"}])
    bound(api, "extended", extendedResourceClaimStatus={"resourceClaimName": "extended-claim-abc"})
    bound(api, "finished", phase="Succeeded", resourceClaimStatuses=[{"name": "g", "resourceClaimName": "old"}])
    bound(api, "elsewhere", node="other-node", resourceClaimStatuses=[{"name": "g", "resourceClaimName": "far"}])
    bound(api, "plain")  # no claims
    bound(api, "pending-template", resourceClaimStatuses=[{"name": "g", "resourceClaimName": None}])
    async with KubeClient(kubeconfig_access(write_kubeconfig(tmp_path, api.url))) as client:
        pods = await NodePodClaims(client, node_name=NODE).list()
    assert {p.pod: p.claims for p in pods} == {
        "named": ("shared-gpu",),
        "templated": ("templated-gpu-x7k",),
        "extended": ("extended-claim-abc",),
    }
    (query,) = [r.query for r in api.requests if r.path == "/api/v1/pods"]
    assert query == {"fieldSelector": f"spec.nodeName={NODE}", "resourceVersion": "0"}


class Pods:
    def __init__(self, *pods: PodClaims) -> None:
        self.pods = list(pods)
        self.down = ""
        self.lists = 0

    async def list(self) -> list[PodClaims]:
        self.lists += 1
        if self.down:
            raise KubeError(self.down, status=503)
        return list(self.pods)


GPU_OF = {"gpu-0": "GPU-0", "gpu-1": "GPU-1", "gpu-1-mig-9-0-1": "GPU-1"}


def draining_from_dra(gpu: str) -> OwnershipState:
    table = OwnershipTable(version="v", owners={"GPU-0": Owner.NONE, "GPU-1": Owner.DRA})
    return OwnershipState(replace(table, draining={gpu: Drain(Owner.DRA, Owner.DEVICE_PLUGIN, since=0.0)}))


def allocated(pods: Pods, claims: FakeClaimSource, ownership: OwnershipState, prepared: set[str]) -> AllocatedClaims:
    return AllocatedClaims(
        pods=pods,
        claims=claims,
        driver=DRIVER,
        pool="node-a",
        gpu_of=GPU_OF.get,
        prepared=prepared,
        ownership=ownership,
        clock=lambda: 42.0,
    )


async def test_allocated_claims_on_our_devices_hold_their_gpus_until_prepared() -> None:
    claims = FakeClaimSource()
    claims.add("c0", result("gpu-0"), namespace="ml", uid="u0")
    claims.add("c1", result("gpu-1-mig-9-0-1"), result("gpu-1"), namespace="ml", uid="u1")
    claims.add("theirs", result("gpu-0", driver="gpu.nvidia.com"), namespace="ml", uid="u2")
    claims.add("elsewhere", result("gpu-0", pool="node-b"), namespace="ml", uid="u3")
    claims.add("waiting", result("gpu-0"), namespace="ml", uid="u4", allocated=False)
    claims.add("done", result("gpu-0"), namespace="ml", uid="u5")
    pods = Pods(
        PodClaims("ml", "p0", "pod-0", ("c0", "theirs", "elsewhere")),
        PodClaims("ml", "p1", "pod-1", ("c1", "waiting", "done", "gone")),
    )
    view = allocated(pods, claims, draining_from_dra("GPU-0"), prepared={"u5"})
    assert not view.view().known  # never listed: a drain waits
    await view.refresh()
    seen = view.view()
    assert seen.known and seen.as_of == 42.0
    assert {g: [(h.name, h.devices) for h in hs] for g, hs in seen.holders.items()} == {
        "GPU-0": [("c0", ("gpu-0",))],
        "GPU-1": [("c1", ("gpu-1-mig-9-0-1", "gpu-1"))],
    }
    assert seen.holders["GPU-0"][0].detail == "allocated for pod p0, not prepared yet"
    reads = len(claims.calls)
    await view.refresh()
    assert len(claims.calls) == reads  # a bound pod's claims are read once


async def test_a_failing_list_or_claim_read_makes_the_view_unknown() -> None:
    claims = FakeClaimSource()
    claims.add("c0", result("gpu-0"), namespace="ml", uid="u0")
    pods = Pods(PodClaims("ml", "p0", "pod-0", ("c0",)))
    view = allocated(pods, claims, draining_from_dra("GPU-0"), prepared=set())
    pods.down = "503 from the API server"
    await view.refresh()
    assert not view.view().known and "503 from the API server" in view.view().reason
    pods.down = ""
    claims.down = "etcd timeout"
    await view.refresh()
    assert not view.view().known and "etcd timeout" in view.view().reason


def test_it_is_needed_only_while_a_gpu_drains_away_from_dra() -> None:
    view = allocated(Pods(), FakeClaimSource(), draining_from_dra("GPU-0"), prepared=set())
    assert view.needed()
    table = OwnershipTable(version="v", owners={"GPU-0": Owner.DRA})
    view = allocated(Pods(), FakeClaimSource(), OwnershipState(table), prepared=set())
    assert not view.needed()
    closing = replace(table, draining={"GPU-0": Drain(Owner.DEVICE_PLUGIN, Owner.DRA, since=0.0, closing=True)})
    assert not allocated(Pods(), FakeClaimSource(), OwnershipState(closing), prepared=set()).needed()


def test_without_api_access_nothing_is_allocated() -> None:
    view = AllocatedClaims(
        pods=None,
        claims=FakeClaimSource(),
        driver=DRIVER,
        pool="node-a",
        gpu_of=GPU_OF.get,
        prepared=set(),
        ownership=draining_from_dra("GPU-0"),
        clock=lambda: 7.0,
    )
    assert view.view().known and view.view().holders == {} and view.view().as_of == 7.0
