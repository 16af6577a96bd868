"""Shared GPUs end to end: one CDI device per share, the GPU's memory never oversold, shares
prepared and unprepared alone, MPS limits per share, and every malformed allocation refused."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator

import pytest

from agent.cdi import spec as cdi_spec
from agent.core.partitioning import PartitionErrorKind
from agent.dra.claims.driver import PrepareTimeouts
from agent.dra.claims.shares import share_env
from tests.dra_fakes import FAST, DraHarness, answer, dra_harness, gpu_config, opaque, result
from tests.test_plugin_fakes import wait_for

pytestmark = pytest.mark.integration

KIND = "k8s.gpu-node-agent.nvidia.com/claim"
GIB = 1 << 30


def share(share_id: str, memory: str = "38Gi", device: str = "gpu-0-shared", request: str = "gpu") -> object:
    return result(device, request=request, share_id=share_id, memory=memory)


@pytest.fixture
async def h() -> AsyncIterator[DraHarness]:
    async with dra_harness(publish="shared") as harness:
        await harness.kubelet().register()
        yield harness


@pytest.fixture
async def mps() -> AsyncIterator[DraHarness]:
    async with dra_harness(publish="shared", dra={"sharing": {"mps": True}}) as harness:
        await harness.kubelet().register()
        yield harness


def spec_of(h: DraHarness, uid: str) -> cdi_spec.Spec:
    return cdi_spec.loads((h.cdi_root / f"k8s.gpu-node-agent.nvidia.com-claim_{uid}.json").read_text())


async def test_each_share_is_a_cdi_device_named_after_its_share_id(h: DraHarness) -> None:
    ref = h.claims.add("two", share("a1"), share("b2", request="other"))  # type: ignore[arg-type]
    response = await h.prepare(ref)
    devices = response.claims[ref.uid].devices
    assert [(d.device_name, d.share_id) for d in devices] == [("gpu-0-shared", "a1"), ("gpu-0-shared", "b2")]
    ids = [d.cdi_device_ids[0] for d in devices]
    assert ids == [f"{KIND}={ref.uid}-{h.gpu(0)}-share-a1", f"{KIND}={ref.uid}-{h.gpu(0)}-share-b2"]
    assert set(spec_of(h, ref.uid).qualified_names()) == set(ids)
    stored = json.loads(h.checkpoint.read_text())["data"]["claims"][0]["devices"]
    assert [(d["shareID"], d["shareMemory"]) for d in stored] == [("a1", 38 * GIB), ("b2", 38 * GIB)]


async def test_the_gpu_memory_is_never_oversold_and_shares_leave_alone(h: DraHarness) -> None:
    # the simulated H100 has 81559 MiB: two shares of 38 GiB fit, a third of 4 GiB does not
    a = h.claims.add("a", share("a", "38Gi"))  # type: ignore[arg-type]
    b = h.claims.add("b", share("b", "38Gi"))  # type: ignore[arg-type]
    c = h.claims.add("c", share("c", "4Gi"))  # type: ignore[arg-type]
    response = await h.prepare(a, b, c)
    assert answer(response, a.uid) and answer(response, b.uid)
    error = response.claims[c.uid].error
    assert "more exceed its 85520809984 bytes" in error
    assert h.metric("gpu_agent_dra_claim_errors_total", operation="prepare", reason="in-use") == 1.0
    assert (await h.unprepare(a)).claims[a.uid].error == ""  # one share goes, the other stays
    assert set(h.m.driver.prepared) == {b.uid}
    assert answer(await h.prepare(c), c.uid)  # now it fits
    details = h.m.gpu_details()[h.gpu(0)]
    assert details["shared_memory"]["allocated"] == "42Gi"  # type: ignore[index]
    assert h.metric("gpu_agent_dra_shares", uuid=h.gpu(0), index="0") == 2.0


async def test_a_share_and_a_whole_gpu_never_sit_together() -> None:
    publish = {"default": "shared", "nodes": [{"match": {"names": ["node-a"]}, "gpus": {"1": "whole"}}]}
    async with dra_harness(publish=publish) as h:
        await h.kubelet().register()
        assert [d.name for d in h.m.driver.gate.devices()][:2] == ["gpu-0-shared", "gpu-1"]
        ref = h.claims.add("wrong", result("gpu-0"))  # a name only the whole mode has
        error = (await h.prepare(ref)).claims[ref.uid].error
        assert "no such device" in error and "GPU 0 publish mode shared" in error


@pytest.mark.parametrize(
    ("make", "text"),
    [
        (lambda: result("gpu-0-shared", memory="8Gi"), "needs a share ID"),
        (lambda: result("gpu-0-shared", share_id="../x", memory="8Gi"), "needs a share ID"),
        (lambda: result("gpu-0-shared", share_id="x" * 200, memory="8Gi"), "needs a share ID"),
        (lambda: result("gpu-0-shared", share_id="s"), "consumedCapacity.memory"),
        (lambda: result("gpu-0-shared", share_id="s", memory="lots"), "not a quantity"),
        (lambda: result("gpu-0-shared", share_id="s", memory="-1Gi"), "negative"),
        (lambda: result("gpu-0-shared", share_id="s", memory="0"), "is not a share of"),
        (lambda: result("gpu-0-shared", share_id="s", memory="1Ti"), "is not a share of"),
        (lambda: result("gpu-0-shared", share_id="s", memory="1" * 80), "not a quantity"),
        (lambda: result("gpu-0-shared", share_id="s", memory="0.5"), "not a whole number of bytes"),
    ],
    ids=["no-id", "bad-id", "long-id", "no-memory", "garbage", "negative", "zero", "too-big", "long", "fraction"],
)
async def test_every_malformed_share_is_refused_per_claim(h: DraHarness, make: object, text: str) -> None:
    ref = h.claims.add("bad", make())  # type: ignore[operator]
    good = h.claims.add("good", share("ok", "8Gi"))  # type: ignore[arg-type]
    response = await h.prepare(ref, good)
    assert text in response.claims[ref.uid].error
    assert answer(response, good.uid)
    assert h.claim_specs() == {good.uid}


async def test_a_claim_config_cannot_set_the_mps_variables(h: DraHarness) -> None:
    config = opaque(gpu_config({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}))
    ref = h.claims.add("greedy", share("s", "8Gi"), configs=[config])  # type: ignore[arg-type]
    assert "reserved for the driver" in (await h.prepare(ref)).claims[ref.uid].error


def test_share_limits_follow_the_allocated_memory() -> None:
    env = share_env("GPU-x", 20 * GIB, 80 * GIB)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "GPU-x=20480M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert share_env("GPU-x", 1, 80 * GIB)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"
    assert share_env("GPU-x", 80 * GIB, 80 * GIB)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"


async def test_mps_shares_get_their_limits_and_the_daemons_directories(mps: DraHarness) -> None:
    assert mps.mps is not None
    device = mps.m.driver.gate.devices()[0]
    assert device.attributes["sharing"].value == "mps" and device.attributes["memoryIsolation"].value == "mps-limit"
    ref = mps.claims.add("a", share("s1", "20Gi"))  # type: ignore[arg-type]
    answer(await mps.prepare(ref), ref.uid)
    gpu = mps.gpu(0)
    assert mps.mps.commands == [
        f"start {gpu}",
        "set_default_active_thread_percentage 100",
        f"set_default_device_pinned_mem_limit {gpu} 81559M",
    ]
    (edits,) = [d.container_edits for d in spec_of(mps, ref.uid).devices]
    assert {
        "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
        f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={gpu}=20480M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=26",  # 20 GiB of 81559 MiB, rounded up
    } <= set(edits.env)
    mounts = {(m.host_path, m.container_path) for m in edits.mounts}
    assert mounts == {
        (str(mps.root / "mps" / gpu / "pipe"), "/tmp/nvidia-mps"),
        (str(mps.root / "mps" / gpu / "log"), "/var/log/nvidia-mps"),
    }
    second = mps.claims.add("b", share("s2", "20Gi"))  # type: ignore[arg-type]
    answer(await mps.prepare(second), second.uid)
    assert mps.mps.commands.count(f"start {gpu}") == 1  # one daemon per GPU
    await mps.unprepare(ref)
    assert f"quit {gpu}" not in mps.mps.commands  # a share still uses it
    await mps.unprepare(second)
    assert mps.mps.commands[-1] == f"quit {gpu}"


async def test_an_mps_daemon_that_will_not_start_fails_the_share(mps: DraHarness) -> None:
    assert mps.mps is not None
    mps.mps.fail = PartitionErrorKind.NOT_SUPPORTED
    ref = mps.claims.add("a", share("s1", "8Gi"))  # type: ignore[arg-type]
    error = (await mps.prepare(ref)).claims[ref.uid].error
    assert "starting the MPS control daemon" in error and "not-supported" in error
    assert mps.claim_specs() == set()


async def test_turning_mps_on_waits_for_the_time_sliced_shares() -> None:
    async with dra_harness(publish="shared") as h:
        await h.kubelet().register()
        ref = h.claims.add("a", share("s1", "8Gi"))  # type: ignore[arg-type]
        await h.prepare(ref)
        assert h.set_publish("shared", mps=True)
        mode = h.m.driver.gate.modes()[h.gpu(0)]
        assert mode.effective is None and mode.waiting_for == ("default/a",)
        assert h.m.driver.gate.modes()[h.gpu(1)].effective is not None
        await h.unprepare(ref)
        assert h.m.driver.gate.devices()[0].attributes["sharing"].value == "mps"


async def test_mps_shares_of_two_gpus_in_one_claim_are_refused(mps: DraHarness) -> None:
    ref = mps.claims.add("two", share("a", "8Gi"), share("b", "8Gi", device="gpu-1-shared", request="b"))  # type: ignore[arg-type]
    error = (await mps.prepare(ref)).claims[ref.uid].error
    assert "MPS shares of 2 GPUs" in error
    assert mps.mps is not None and not mps.mps.running  # nothing started for it... or released again


async def test_a_share_waits_briefly_for_the_memory_an_unprepare_is_about_to_free() -> None:
    """The scheduler gives the memory to the next claim as soon as the old pod is deleted, before
    the kubelet unprepares the old claim: the prepare waits for it instead of failing into the
    kubelet's minute of back-off."""
    tuning = dataclasses.replace(FAST, timeouts=PrepareTimeouts(api_s=0.3, lock_s=1.0, held_s=5.0))
    async with dra_harness(publish="shared", tuning=tuning) as h:
        await h.kubelet().register()
        old = h.claims.add("old", share("a", "40Gi"))  # type: ignore[arg-type]
        other = h.claims.add("other", share("b", "38Gi"))  # type: ignore[arg-type]
        await h.prepare(old, other)
        new = h.claims.add("new", share("c", "38Gi"))  # type: ignore[arg-type]
        waiting = asyncio.ensure_future(h.prepare(new))
        await wait_for(lambda: new in h.claims.calls, what="the new claim read (then refused, then waiting)")
        await asyncio.sleep(0)
        assert not waiting.done()  # held: waiting for the memory, not failed
        assert (await h.unprepare(old)).claims[old.uid].error == ""
        assert answer(await waiting, new.uid)
