"""Dynamic MIG and shared GPUs through the whole agent: a real process on the simulated backend
(its MIG instances and MPS daemons), a grpcio kubelet, the fake API server.

The composition root wires the backend's MigControl and MpsControl into DRA and re-reads the
inventory after an instance appears, so the claim's CDI spec, ``/debug/state`` and the health
stream see it; ``dra.publish`` changes live, and a GPU whose instances are held waits.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from tests._grpcio import dra_v1_pb2 as dra_pb
from tests._grpcio import dra_v1_pb2_grpc as dra_grpc
from tests.fake_apiserver import NODE
from tests.test_dra_e2e import DRIVER, Node, eventually, running_node

pytestmark = pytest.mark.integration

CONFIG = """
cdi: {reconcile_interval_s: 0.5}
health: {check_interval_s: 0.2}
ownership: {default: dra}
dra:
  publish:
    default: dynamic-mig
    nodes:
      - match: {names: [NODE]}
        gpus: {"6": shared, "7": shared}
  sharing: {mps: true}
""".replace("NODE", NODE)


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    async with running_node(CONFIG) as found:
        yield found


def claim(node: Node, name: str, *results: dict[str, Any]) -> dra_pb.Claim:
    node.api.put_claim(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"namespace": "ml", "name": name, "uid": f"uid-{name}"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}},
            "status": {
                "allocation": {
                    "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, **r} for r in results]}
                },
                "reservedFor": [{"resource": "pods", "name": f"pod-{name}", "uid": f"pod-{name}"}],
            },
        }
    )
    return dra_pb.Claim(namespace="ml", name=name, uid=f"uid-{name}")


async def call(endpoint: str, method: str, *claims: dra_pb.Claim) -> Any:
    async with grpc.aio.insecure_channel(f"unix://{endpoint}") as channel:
        stub = dra_grpc.DRAPluginStub(channel)
        if method == "prepare":
            return await stub.NodePrepareResources(dra_pb.NodePrepareResourcesRequest(claims=claims), timeout=45)
        return await stub.NodeUnprepareResources(dra_pb.NodeUnprepareResourcesRequest(claims=claims), timeout=45)


def devices_of(node: Node) -> set[str]:
    return {d["name"] for s in node.api.slices_of() for d in s["spec"].get("devices") or ()}


def spec_device(node: Node, cdi_id: str) -> dict[str, Any]:
    kind, _, name = cdi_id.partition("=")
    for path in node.agent.cdi_root.glob("*claim_*.json"):
        spec = json.loads(path.read_text())
        for device in spec["devices"]:
            if spec["kind"] == kind and device["name"] == name:
                found: dict[str, Any] = device
                return found
    raise AssertionError(f"{cdi_id} is in no CDI spec")


async def test_partitions_and_shares_through_the_whole_agent(node: Node) -> None:
    await asyncio.to_thread(node.agent.wait_port)
    endpoint = await node.register_dra()
    # the slices are written one after another: wait for the last of them, not the first
    expected = {"gpu-0-mig-3g40gb-9-4", "gpu-6-shared", "gpu-7-shared", "gpu-0"}
    await eventually(lambda: expected <= devices_of(node), "partitions and shares published")
    counter_slices = [s for s in node.api.slices_of() if s["spec"].get("sharedCounters")]
    assert len(counter_slices) == 1 and len(counter_slices[0]["spec"]["sharedCounters"]) == 6
    await eventually(lambda: node.agent.get("/readyz")[0] == 200, "ready")

    # a 3g.40gb partition: the simulated backend makes the instance, the spec names it
    part = claim(node, "part", {"device": "gpu-0-mig-3g40gb-9-4"})
    entry = (await call(endpoint, "prepare", part)).claims["uid-part"]
    assert entry.error == ""
    (made,) = [m for m in node.agent.state()["devices"][0]["mig"] if m["profile"] == "3g.40gb"]
    assert entry.devices[0].cdi_device_ids[0].endswith(made["uuid"])
    spec_device(node, entry.devices[0].cdi_device_ids[0])
    dra = node.agent.state()["devices"][0]["mechanism_details"]["dra"]
    assert [(p["profile"], p["claim"]) for p in dra["partitions"]] == [("3g.40gb", "ml/part")]
    assert dra["free_counters"]["memory-slice-4"] == 0 and dra["free_counters"]["memory-slice-0"] == 1

    # a share under MPS: its limits and the daemon's directories in its CDI device
    share = claim(node, "share", {"device": "gpu-6-shared", "shareID": "3f1c", "consumedCapacity": {"memory": "40Gi"}})
    entry = (await call(endpoint, "prepare", share)).claims["uid-share"]
    assert entry.error == "" and entry.devices[0].share_id == "3f1c"
    device = spec_device(node, entry.devices[0].cdi_device_ids[0])
    env = device["containerEdits"]["env"]
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in env
    assert any(e.startswith("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=") and e.endswith("=40960M") for e in env)
    assert {m["containerPath"] for m in device["containerEdits"]["mounts"]} == {
        "/tmp/nvidia-mps",
        "/var/log/nvidia-mps",
    }

    # the operator moves GPU 0 to whole: it waits for the partition, unpublished meanwhile
    (node.root / "config.yaml").write_text(CONFIG.replace("default: dynamic-mig", "default: whole"))
    await eventually(lambda: not {d for d in devices_of(node) if d.startswith("gpu-0")}, "GPU 0 unpublished")
    publish = node.agent.state()["devices"][0]["mechanism_details"]["dra"]["publish"]
    assert publish["state"] == "changing->whole" and publish["waiting_for"] == ["ml/part"]
    await eventually(lambda: "gpu-1" in devices_of(node), "GPU 1 whole at once")  # it held nothing

    assert (await call(endpoint, "unprepare", part)).claims["uid-part"].error == ""
    await eventually(lambda: "gpu-0" in devices_of(node), "GPU 0 whole again")
    assert not [m for m in node.agent.state()["devices"][0]["mig"]]
    assert (await call(endpoint, "unprepare", share)).claims["uid-share"].error == ""
