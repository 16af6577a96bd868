"""NodePrepareResources / NodeUnprepareResources over v1 and v1beta1, with grpcio as the kubelet."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agent.cdi import spec as cdi_spec
from agent.core.config.schema import Owner
from agent.kube.claims.model import ClaimRef
from tests.dra_fakes import DRIVER, NODE, DraHarness, answer, dra_harness, gpu_config, opaque, result
from tests.test_ownership import granted_gpus
from tests.test_plugin_fakes import wait_for

pytestmark = pytest.mark.integration

APIS = ["v1", "v1beta1"]
KIND = "k8s.gpu-node-agent.nvidia.com/claim"


@pytest.fixture
async def h() -> AsyncIterator[DraHarness]:
    async with dra_harness() as harness:
        await harness.kubelet().register()
        yield harness


def spec_of(h: DraHarness, uid: str) -> cdi_spec.Spec:
    return cdi_spec.loads((h.cdi_root / f"k8s.gpu-node-agent.nvidia.com-claim_{uid}.json").read_text())


def checkpoint_claims(h: DraHarness) -> dict[str, Any]:
    data = json.loads(h.checkpoint.read_text())["data"]
    return {c["uid"]: c for c in data["claims"]}


@pytest.mark.parametrize("api", APIS)
async def test_empty_call_answers_an_empty_map(h: DraHarness, api: str) -> None:
    assert dict((await h.prepare(api=api)).claims) == {}
    assert dict((await h.unprepare(api=api)).claims) == {}


@pytest.mark.parametrize("api", APIS)
async def test_prepare_answers_devices_whose_cdi_names_exist_on_disk(h: DraHarness, api: str) -> None:
    ref = h.claims.add("train", result("gpu-0"), result("gpu-3", request="aux"))
    response = await h.prepare(ref, api=api)
    assert set(response.claims) == {ref.uid}
    devices = answer(response, ref.uid)
    assert devices == [
        (("gpu",), NODE, "gpu-0", (f"{KIND}={ref.uid}-{h.gpu(0)}",)),
        (("aux",), NODE, "gpu-3", (f"{KIND}={ref.uid}-{h.gpu(3)}",)),
    ]
    # every name handed to the kubelet is defined by the claim's spec, on disk before the answer
    assert set(spec_of(h, ref.uid).qualified_names()) == {d[3][0] for d in devices}
    assert checkpoint_claims(h)[ref.uid]["devices"][0]["uuid"] == h.gpu(0)
    assert h.metric("gpu_agent_dra_prepare_claims_total", result="prepared") == 1.0


async def test_v1_and_v1beta1_answer_identically(h: DraHarness) -> None:
    a = h.claims.add("a", result("gpu-1", request="main/small"))
    b = h.claims.add("b", result("gpu-2", request="main/small"))
    v1, v1beta1 = await h.prepare(a, api="v1"), await h.prepare(b, api="v1beta1")
    strip = lambda devices, uid: [(r, p, d, tuple(c.replace(uid, "U") for c in cdi)) for r, p, d, cdi in devices]  # noqa: E731
    assert strip(answer(v1, a.uid), a.uid) == [(("main",), NODE, "gpu-1", (f"{KIND}=U-{h.gpu(1)}",))]
    assert strip(answer(v1beta1, b.uid), b.uid) == [(("main",), NODE, "gpu-2", (f"{KIND}=U-{h.gpu(2)}",))]
    # the same claim asked again through the other version: the same answer
    assert answer(await h.prepare(a, api="v1beta1"), a.uid) == answer(v1, a.uid)


async def test_share_id_is_sent_only_when_the_result_has_one(h: DraHarness) -> None:
    ref = h.claims.add("shared", result("gpu-0", share_id="a1b2"), result("gpu-1", request="other"))
    devices = (await h.prepare(ref, api="v1")).claims[ref.uid].devices
    assert devices[0].HasField("share_id") and devices[0].share_id == "a1b2"
    assert not devices[1].HasField("share_id")
    beta = (await h.prepare(ref, api="v1beta1")).claims[ref.uid].devices
    assert [d.device_name for d in beta] == ["gpu-0", "gpu-1"]


async def test_one_answer_per_uid_and_failures_stay_per_claim(h: DraHarness) -> None:
    good = h.claims.add("good", result("gpu-0"))
    missing = ClaimRef(namespace="default", name="nope", uid="uid-nope")
    response = await h.prepare(good, missing, good)
    assert set(response.claims) == {good.uid, missing.uid}
    assert response.claims[good.uid].error == "" and len(response.claims[good.uid].devices) == 1
    assert "not found" in response.claims[missing.uid].error
    assert list(response.claims[missing.uid].devices) == []


def _bad_inputs(h: DraHarness) -> dict[str, tuple[ClaimRef, str, str]]:
    """name -> (claim reference, expected error text, metric reason)."""
    add = h.claims.add
    add("recreated", result("gpu-0"), uid="uid-new")
    return {
        "claim missing": (ClaimRef("default", "ghost", "uid-ghost"), "not found", "claim-not-found"),
        "uid changed": (ClaimRef("default", "recreated", "uid-old"), "has UID 'uid-new'", "uid-mismatch"),
        "not allocated": (add("pending", allocated=False), "is not allocated", "not-allocated"),
        "another node's pool": (
            add("elsewhere", result("gpu-0", pool="node-b")),
            "pool 'node-b'",
            "not-allocated-here",
        ),
        "another driver": (
            add("nvidia", result("gpu-0", driver="gpu.nvidia.com")),
            "no device of driver",
            "not-allocated-here",
        ),
        "unknown device": (add("unknown", result("gpu-99")), "no such device", "device-unknown"),
        "not DRA-owned": (add("theirs", result("gpu-5")), "not given to DRA", "not-dra-owned"),
        "unhealthy": (add("sick", result("gpu-6")), "is unhealthy", "unhealthy"),
        "in use": (add("second", result("gpu-7")), "already prepared for claim default/first", "in-use"),
        "unknown config field": (
            add("cfg1", result("gpu-1"), configs=[opaque(gpu_config(sharing={"timeSlicing": 2}))]),
            "unknown field 'sharing'",
            "bad-config",
        ),
        "wrong config kind": (
            add("cfg2", result("gpu-1"), configs=[opaque({**gpu_config(), "kind": "MigConfig"})]),
            "kind: unsupported 'MigConfig'",
            "bad-config",
        ),
        "newer config version": (
            add(
                "cfg3",
                result("gpu-1"),
                configs=[opaque({**gpu_config(), "apiVersion": "gpu-node-agent.nvidia.com/v2"})],
            ),
            "apiVersion: unsupported",
            "bad-config",
        ),
        "reserved variable": (
            add("cfg4", result("gpu-1"), configs=[opaque(gpu_config({"NVIDIA_VISIBLE_DEVICES": "all"}))]),
            "reserved for the driver",
            "bad-config",
        ),
        "bad variable name": (
            add("cfg5", result("gpu-1"), configs=[opaque(gpu_config({"1BAD": "x"}))]),
            "invalid variable name '1BAD'",
            "bad-config",
        ),
        "config not an object": (
            add("cfg6", result("gpu-1"), configs=[opaque(["not", "an", "object"])]),
            "parameters must be an object",
            "bad-config",
        ),
        "bad claim uid": (ClaimRef("default", "weird", "../etc"), "cannot be used in a CDI name", "bad-request"),
    }


async def test_every_bad_input_is_a_clear_per_claim_error(h: DraHarness) -> None:
    h.set_owner({"5": Owner.DEVICE_PLUGIN}, "2")
    h.fault(h.gpu(6))
    first = h.claims.add("first", result("gpu-7"))
    assert answer(await h.prepare(first), first.uid)
    cases = _bad_inputs(h)
    good = h.claims.add("fine", result("gpu-2"))
    response = await h.prepare(good, *(ref for ref, _, _ in cases.values()))
    assert set(response.claims) == {good.uid} | {ref.uid for ref, _, _ in cases.values()}
    assert answer(response, good.uid)  # the good claim of the batch is prepared anyway
    for name, (ref, text, reason) in cases.items():
        error = response.claims[ref.uid].error
        assert text in error, f"{name}: {error!r}"
        assert h.metric("gpu_agent_dra_claim_errors_total", operation="prepare", reason=reason) >= 1, name
    # nothing of a failed claim is left behind
    assert h.claim_specs() == {first.uid, good.uid}
    assert set(checkpoint_claims(h)) == {first.uid, good.uid}


async def test_api_down_is_a_per_claim_error(h: DraHarness) -> None:
    ref = h.claims.add("c", result("gpu-0"))
    h.claims.down = "GET https://api/.../resourceclaims/c: 503 Service Unavailable"
    error = (await h.prepare(ref)).claims[ref.uid].error
    assert "failed: GET https://api" in error and "503" in error
    h.claims.down = ""
    assert answer(await h.prepare(ref), ref.uid)  # the kubelet's retry works


async def test_hanging_api_answers_within_the_bound(h: DraHarness) -> None:
    ref = h.claims.add("c", result("gpu-0"))
    h.claims.hang = True
    # the kubelet's own deadline would be 45 s; the fake's timeout is 0.3 s
    response = await asyncio.wait_for(h.prepare(ref), timeout=5)
    assert "took longer than 0.3s" in response.claims[ref.uid].error
    assert h.metric("gpu_agent_dra_claim_errors_total", operation="prepare", reason="timeout") == 1.0
    assert h.claim_specs() == set()


async def test_repeated_prepare_answers_from_the_checkpoint(h: DraHarness) -> None:
    ref = h.claims.add("c", result("gpu-0"), result("gpu-1", request="b/x"))
    first = await h.prepare(ref)
    calls = len(h.claims.calls)
    h.claims.down = "the API server is gone"  # a stored answer needs no API
    again = await h.prepare(ref, api="v1beta1")
    assert answer(again, ref.uid) == answer(first, ref.uid)
    assert len(h.claims.calls) == calls
    assert h.metric("gpu_agent_dra_prepare_claims_total", result="already-prepared") == 1.0


async def test_unprepare_removes_spec_and_entry_and_is_idempotent(h: DraHarness) -> None:
    ref = h.claims.add("c", result("gpu-0"))
    await h.prepare(ref)
    assert h.claim_specs() == {ref.uid}
    unknown = ClaimRef("default", "never", "uid-never")
    response = await h.unprepare(ref, unknown)
    assert {uid: e.error for uid, e in response.claims.items()} == {ref.uid: "", unknown.uid: ""}
    assert h.claim_specs() == set() and checkpoint_claims(h) == {}
    response = await h.unprepare(ref, api="v1beta1")
    assert response.claims[ref.uid].error == ""
    # the device is free again
    other = h.claims.add("next", result("gpu-0"))
    assert answer(await h.prepare(other), other.uid)


async def test_config_env_reaches_the_cdi_spec_and_the_checkpoint(h: DraHarness) -> None:
    ref = h.claims.add(
        "c",
        result("gpu-0", request="train"),
        result("gpu-1", request="eval/small"),
        configs=[
            opaque(gpu_config({"NCCL_DEBUG": "WARN", "A": "class"}), source="FromClass"),
            opaque(gpu_config({"NCCL_DEBUG": "INFO"}), requests=["train"]),
            opaque(gpu_config({"B": "sub only"}), requests=["eval/small"]),
            opaque({"anything": "for another driver"}, driver="gpu.nvidia.com"),
        ],
    )
    await h.prepare(ref)
    devices = {d.name: d.container_edits.env for d in spec_of(h, ref.uid).devices}
    train, evaluation = devices[f"{ref.uid}-{h.gpu(0)}"], devices[f"{ref.uid}-{h.gpu(1)}"]
    assert "NCCL_DEBUG=INFO" in train and "A=class" in train and "NCCL_DEBUG=WARN" not in train
    assert "NCCL_DEBUG=WARN" in evaluation and "B=sub only" in evaluation
    recorded = {d["device"]: d["env"] for d in checkpoint_claims(h)[ref.uid]["devices"]}
    assert recorded == {
        "gpu-0": {"NCCL_DEBUG": "INFO", "A": "class"},
        "gpu-1": {"NCCL_DEBUG": "WARN", "A": "class", "B": "sub only"},
    }


async def test_admin_access_may_share_a_device_in_use(h: DraHarness) -> None:
    user = h.claims.add("user", result("gpu-0"))
    monitor = h.claims.add("monitor", result("gpu-0", admin=True))
    thief = h.claims.add("thief", result("gpu-0"))
    assert answer(await h.prepare(user), user.uid)
    assert answer(await h.prepare(monitor), monitor.uid)
    assert "already prepared" in (await h.prepare(thief)).claims[thief.uid].error


async def test_a_claim_can_hold_two_results_on_one_shared_device(h: DraHarness) -> None:
    ref = h.claims.add("c", result("gpu-0", share_id="s1"), result("gpu-0", request="b", share_id="s2"))
    devices = (await h.prepare(ref)).claims[ref.uid].devices
    assert [(d.device_name, d.share_id) for d in devices] == [("gpu-0", "s1"), ("gpu-0", "s2")]
    assert devices[0].cdi_device_ids == devices[1].cdi_device_ids


async def test_mig_devices_and_their_gpu_never_go_to_two_claims() -> None:
    async with dra_harness(preset="a100-4x-mig") as h:
        await h.kubelet().register()
        migs = [d.name for d in __import__("agent.dra.devices", fromlist=["x"]).dra_devices(h.inventory)]
        first, second = [n for n in migs if n.startswith("gpu-1-")][:2]
        a = h.claims.add("a", result(first))
        b = h.claims.add("b", result(second))
        c = h.claims.add("c", result(first))
        response = await h.prepare(a, b, c)
        assert response.claims[a.uid].error == "" and response.claims[b.uid].error == ""
        assert "already" in response.claims[c.uid].error
        # a whole GPU is not offered in MIG mode: its name is unknown here
        whole = h.claims.add("whole", result("gpu-1"))
        assert "no such device" in (await h.prepare(whole)).claims[whole.uid].error


async def test_a_batch_costs_one_checkpoint_write(h: DraHarness) -> None:
    refs = [h.claims.add(f"c{i}", result(f"gpu-{i}")) for i in range(8)]
    before = h.metric("gpu_agent_dra_checkpoint_writes_total", result="ok")
    response = await h.prepare(*refs)
    assert all(e.error == "" for e in response.claims.values())
    assert h.metric("gpu_agent_dra_checkpoint_writes_total", result="ok") == before + 1
    await h.unprepare(*refs)
    assert h.metric("gpu_agent_dra_checkpoint_writes_total", result="ok") == before + 2


async def test_debug_state_and_usage_show_claims_per_gpu(h: DraHarness) -> None:
    ref = h.claims.add("c", result("gpu-2"), namespace="team-a")
    await h.prepare(ref)
    usage = h.m.usage()
    assert usage.known and [x.name for x in usage.holders[h.gpu(2)]] == ["c"]
    holder = usage.holders[h.gpu(2)][0]
    assert (holder.kind, holder.namespace, holder.uid, holder.devices) == ("claim", "team-a", ref.uid, ("gpu-2",))
    state = h.m.debug_state()
    assert state["claims_by_gpu"][h.gpu(2)][0]["since"] == holder.since  # type: ignore[index]
    assert state["checkpoint"]["path"] == str(h.checkpoint)  # type: ignore[index]
    assert state["driver"] == DRIVER and state["pool"] == NODE
    assert h.m.advertised_gpus() == granted_gpus(h.ownership.current, Owner.DRA)


async def test_a_kubelet_that_gives_up_mid_prepare_gets_the_stored_answer_on_retry(h: DraHarness) -> None:
    ref = h.claims.add("c", result("gpu-0"))
    entered, gate = asyncio.Event(), asyncio.Event()
    real = h.claims.get_claim

    async def slow(r: ClaimRef) -> Any:
        entered.set()
        await gate.wait()
        return await real(r)

    h.claims.get_claim = slow  # type: ignore[method-assign]
    call = asyncio.create_task(h.prepare(ref))
    await asyncio.wait_for(entered.wait(), 2)
    call.cancel()  # the kubelet restarts: its call and connection are gone
    await asyncio.gather(call, return_exceptions=True)
    gate.set()
    await wait_for(lambda: ref.uid in h.m.driver.prepared, what="the preparation finishing anyway")
    calls = len(h.claims.calls)
    response = await h.prepare(ref)  # the restarted kubelet asks again
    assert answer(response, ref.uid)[0][2] == "gpu-0"
    assert len(h.claims.calls) == calls and h.claim_specs() == {ref.uid}
