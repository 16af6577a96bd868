"""Dynamic MIG end to end through the kubelet's gRPC calls: instances made at prepare, destroyed at
unprepare, never half made, recorded before they exist, collected after a restart, and the mode
change that waits for them."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agent.core.config.schema import PublishMode
from agent.core.inventory.model import MigPlacement
from agent.core.partitioning import PartitionErrorKind
from agent.dra.claims.checkpoint import CheckpointStore, CreatedInstance
from agent.dra.claims.driver import PrepareTimeouts
from tests.dra_fakes import FAST, DraHarness, answer, dra_harness, result
from tests.test_plugin_fakes import wait_for

pytestmark = pytest.mark.integration

KIND = "k8s.gpu-node-agent.nvidia.com/claim"
ONE_G = "gpu-0-mig-1g10gb-19-{}"
THREE_G = "gpu-0-mig-3g40gb-9-{}"


@pytest.fixture
async def h() -> AsyncIterator[DraHarness]:
    async with dra_harness(mig=True, publish="dynamic-mig") as harness:
        await harness.kubelet().register()
        yield harness


def instances(h: DraHarness) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = json.loads(h.checkpoint.read_text())["data"]["instances"]
    return records


def placements(h: DraHarness, gpu: int = 0) -> list[tuple[int, int]]:
    assert h.mig is not None
    return sorted((m.placement.start, m.placement.size) for m in h.mig.instances_by_gpu[h.gpu(gpu)] if m.placement)


async def test_prepare_makes_the_instance_and_the_spec_names_it(h: DraHarness) -> None:
    ref = h.claims.add("a", result(ONE_G.format(3)), result(THREE_G.format(4), request="big"))
    devices = answer(await h.prepare(ref), ref.uid)
    assert placements(h) == [(3, 1), (4, 4)]
    assert h.mig is not None
    made = {m.placement.start: m.uuid for m in h.mig.instances_by_gpu[h.gpu(0)] if m.placement}
    assert devices == [
        (("gpu",), "node-a", ONE_G.format(3), (f"{KIND}={ref.uid}-{made[3]}",)),
        (("big",), "node-a", THREE_G.format(4), (f"{KIND}={ref.uid}-{made[4]}",)),
    ]
    # the new MIG devices are in the inventory (health, CDI) and recorded as the agent's
    assert {made[3], made[4]} <= {m.uuid for m in h.inventory.gpus[0].mig_devices}
    assert sorted((r["placement"]["start"], r["uuid"]) for r in instances(h)) == [(3, made[3]), (4, made[4])]
    assert h.reloads >= 1
    # asked again: the stored answer, nothing made twice
    assert answer(await h.prepare(ref), ref.uid) == devices and h.mig.count() == 2


async def test_unprepare_destroys_exactly_the_claims_instances(h: DraHarness) -> None:
    assert h.mig is not None
    foreign = h.mig.add_foreign(h.gpu(0), 19, 6)
    a = h.claims.add("a", result(ONE_G.format(0)))
    b = h.claims.add("b", result(ONE_G.format(1)))
    await h.prepare(a, b)
    assert (await h.unprepare(a)).claims[a.uid].error == ""
    assert placements(h) == [(1, 1), (6, 1)]
    assert [r["claimUID"] for r in instances(h)] == [b.uid]
    assert (await h.unprepare(a)).claims[a.uid].error == ""  # again: nothing to do
    assert (await h.unprepare(b)).claims[b.uid].error == ""
    assert [m.uuid for m in h.mig.instances_by_gpu[h.gpu(0)]] == [foreign.uuid]  # never touched
    assert instances(h) == []


async def test_the_whole_gpu_of_a_gpu_in_mig_mode_is_its_full_size_instance(h: DraHarness) -> None:
    ref = h.claims.add("whole", result("gpu-2"))
    (device,) = answer(await h.prepare(ref), ref.uid)
    assert placements(h, 2) == [(0, 8)]
    assert h.mig is not None
    (made,) = h.mig.instances_by_gpu[h.gpu(2)]
    assert made.profile == "7g.80gb" and device[3] == (f"{KIND}={ref.uid}-{made.uuid}",)
    # nothing else fits on that GPU now
    other = h.claims.add("other", result("gpu-2-mig-1g10gb-19-5"))
    assert "already prepared for claim default/whole" in (await h.prepare(other)).claims[other.uid].error


async def test_overlapping_partitions_are_refused_before_anything_is_made(h: DraHarness) -> None:
    first = h.claims.add("first", result(THREE_G.format(0)))
    await h.prepare(first)
    assert h.mig is not None
    calls = len(h.mig.calls)
    second = h.claims.add("second", result("gpu-0-mig-2g20gb-14-2"))
    error = (await h.prepare(second)).claims[second.uid].error
    assert "already prepared for claim default/first" in error
    assert len(h.mig.calls) == calls  # refused by the reservation, never asked of the hardware
    inside = h.claims.add("inside", result("gpu-0-mig-1g20gb-15-4"), result(ONE_G.format(5), request="b"))
    assert "overlaps another MIG partition" in (await h.prepare(inside)).claims[inside.uid].error


@pytest.mark.parametrize(
    ("kind", "text"),
    [
        (PartitionErrorKind.INSUFFICIENT_RESOURCES, "insufficient-resources"),
        (PartitionErrorKind.IN_USE, "in-use"),
        (PartitionErrorKind.NOT_SUPPORTED, "not-supported"),
        (PartitionErrorKind.MIG_DISABLED, "mig-disabled"),
    ],
)
async def test_a_failed_create_is_a_per_claim_error_and_leaves_nothing(
    h: DraHarness, kind: PartitionErrorKind, text: str
) -> None:
    assert h.mig is not None
    good = h.claims.add("good", result("gpu-1-mig-1g10gb-19-0"))
    bad = h.claims.add("bad", result(ONE_G.format(0)), result(THREE_G.format(4), request="b"))
    # the bad claim's first instance is made, its second fails: the first goes again (never half made)
    h.mig.fail_create = []
    original = h.mig.create

    async def second_fails(parent: str, profile_id: int, placement: MigPlacement) -> Any:
        if profile_id == 9:
            h.mig.fail_create.append(kind)  # type: ignore[union-attr]
        return await original(parent, profile_id, placement)

    h.mig.create = second_fails  # type: ignore[method-assign]
    response = await h.prepare(good, bad)
    error = response.claims[bad.uid].error
    assert f"failed ({text})" in error and "3g.40gb at memory slices 4-7" in error
    assert answer(response, good.uid)
    assert placements(h, 0) == [] and placements(h, 1) == [(0, 1)]
    assert [r["claimUID"] for r in instances(h)] == [good.uid]
    assert h.metric("gpu_agent_dra_claim_errors_total", operation="prepare", reason="mig-error") == 1.0
    assert bad.uid not in h.claim_specs()


async def test_an_instance_that_will_not_go_keeps_its_claim_prepared(h: DraHarness) -> None:
    assert h.mig is not None
    ref = h.claims.add("a", result(ONE_G.format(2)))
    await h.prepare(ref)
    h.mig.fail_destroy = [PartitionErrorKind.IN_USE]
    error = (await h.unprepare(ref)).claims[ref.uid].error
    assert "in-use" in error
    assert ref.uid in h.m.driver.prepared and placements(h) == [(2, 1)]
    assert (await h.unprepare(ref)).claims[ref.uid].error == ""  # the kubelet's retry
    assert placements(h) == [] and instances(h) == []


async def test_a_restart_destroys_what_it_made_for_nobody_and_nothing_else(h: DraHarness) -> None:
    """A crash between recording an instance and answering: the record names it, the restart
    destroys it; an instance nobody recorded is left alone."""
    assert h.mig is not None
    kept = h.claims.add("kept", result(ONE_G.format(0)))
    await h.prepare(kept)
    await h.stop()
    foreign = h.mig.add_foreign(h.gpu(0), 19, 6)
    interrupted = h.mig.add_foreign(h.gpu(0), 14, 2)  # made by the agent, but the crash came first
    orphan = h.mig.add_foreign(h.gpu(1), 9, 4)
    store = CheckpointStore(h.config.state_dir)
    loaded = store.load()
    records = [
        *loaded.instances,
        # recorded before it was made, never completed
        CreatedInstance(gpu_uuid=h.gpu(0), profile_id=14, placement=MigPlacement(2, 2), claim_uid="uid-crashed"),
        # completed for a claim the kubelet never got an answer for
        CreatedInstance(
            gpu_uuid=h.gpu(1),
            profile_id=9,
            placement=MigPlacement(4, 4),
            claim_uid="uid-lost",
            uuid=orphan.uuid,
            gpu_instance_id=orphan.gpu_instance_id,
            compute_instance_id=orphan.compute_instance_id,
        ),
    ]
    store.write(loaded.claims.values(), boot_id=h.boot_id, instances=records)
    await h.reload()
    await h.restart()
    remaining = {m.uuid for gpu in h.mig.instances_by_gpu.values() for m in gpu}
    assert interrupted.uuid not in remaining and orphan.uuid not in remaining
    assert foreign.uuid in remaining
    assert [r["claimUID"] for r in instances(h)] == [kept.uid]
    assert answer(await h.prepare(kept), kept.uid)  # the prepared claim kept its instance


async def test_after_a_reboot_claims_with_instances_are_prepared_anew(h: DraHarness) -> None:
    assert h.mig is not None
    ref = h.claims.add("a", result(ONE_G.format(0)))
    first = answer(await h.prepare(ref), ref.uid)
    h.mig.instances_by_gpu = {uuid: [] for uuid in h.mig.instances_by_gpu}  # a reboot: instances are gone
    await h.reload()
    calls = len([c for c in h.mig.calls if c[0] == "destroy"])
    await h.restart(boot_id="boot-2")
    assert ref.uid not in h.m.driver.prepared
    assert len([c for c in h.mig.calls if c[0] == "destroy"]) == calls  # an old ID may be someone else's now
    again = answer(await h.prepare(ref), ref.uid)
    assert again[0][2] == first[0][2] and again[0][3] != first[0][3]  # the same device, a new instance
    assert placements(h) == [(0, 1)]


async def test_a_mode_change_waits_for_the_instances(h: DraHarness) -> None:
    ref = h.claims.add("a", result(ONE_G.format(0)))
    await h.prepare(ref)
    h.set_publish("whole")
    gate = h.m.driver.gate
    mode = gate.modes()[h.gpu(0)]
    assert mode.effective is None and mode.waiting_for == ("default/a",)
    assert "unpublished until claim default/a is unprepared" in mode.note
    assert not [d for d in gate.devices() if d.gpu_uuid == h.gpu(0)]  # nothing of GPU 0 is offered
    assert gate.modes()[h.gpu(1)].effective is PublishMode.WHOLE  # nothing held there: at once
    late = h.claims.add("late", result(ONE_G.format(1)))
    error = (await h.prepare(late)).claims[late.uid].error
    assert "no such device" in error and "changing->whole" in error
    await h.unprepare(ref)
    assert gate.modes()[h.gpu(0)].effective is PublishMode.WHOLE
    state = h.m.debug_state()["publish"]
    assert state[h.gpu(0)]["state"] == "whole"  # type: ignore[index]


async def test_partition_health_follows_its_instance(h: DraHarness) -> None:
    ref = h.claims.add("a", result(ONE_G.format(0)))
    await h.prepare(ref)
    assert h.mig is not None
    (made,) = h.mig.instances_by_gpu[h.gpu(0)]
    h.fault(made.uuid)
    reports = {r.device: r for r in h.m.feed.snapshot()}
    assert reports[ONE_G.format(0)].state.value == "unhealthy"
    assert "test" in reports[ONE_G.format(0)].message  # the instance's own record
    # as with MIG devices that already existed, a fault on one marks its GPU: the GPU's free
    # partitions report it too (and leave the slices) until it recovers; other GPUs are untouched
    assert reports[ONE_G.format(1)].state.value == "unhealthy"
    assert reports["gpu-1-mig-1g10gb-19-0"].state.value == "healthy"
    h.fault(made.uuid, healthy=True)
    assert {r.state.value for r in h.m.feed.snapshot()} == {"healthy"}


async def test_debug_state_and_metrics_show_partitions_and_free_slices(h: DraHarness) -> None:
    ref = h.claims.add("a", result(THREE_G.format(4)))
    await h.prepare(ref)
    details = h.m.gpu_details()[h.gpu(0)]
    (partition,) = details["partitions"]  # type: ignore[misc]
    assert partition["profile"] == "3g.40gb" and partition["claim"] == "default/a"
    free = details["free_counters"]
    assert free == {**{f"memory-slice-{i}": 1 for i in range(4)}, **{f"memory-slice-{i}": 0 for i in range(4, 8)},
                    "profile-20-instances": 1}  # fmt: skip
    labels = {"uuid": h.gpu(0), "index": "0"}
    assert h.metric("gpu_agent_dra_free_memory_slices", **labels) == 4.0
    assert h.metric("gpu_agent_dra_mig_partitions", profile="3g.40gb", **labels) == 1.0
    assert h.metric("gpu_agent_dra_publish_mode", mode="dynamic-mig", desired="dynamic-mig", **labels) == 1.0


async def test_an_ampere_gpu_out_of_mig_mode_is_published_whole_and_says_why() -> None:
    async with dra_harness(mig=True, mig_enabled=False, mig_architecture="ampere", publish="dynamic-mig") as h:
        mode = h.m.driver.gate.modes()[h.gpu(0)]
        assert mode.effective is PublishMode.WHOLE and "not in MIG mode" in mode.note and "reset" in mode.note
        assert [d.name for d in h.m.driver.gate.devices()][:2] == ["gpu-0", "gpu-1"]
        ref = h.claims.add("a", result("gpu-0"))
        await h.kubelet().register()
        answer(await h.prepare(ref), ref.uid)
        assert h.mig is not None and h.mig.count() == 0  # a plain whole GPU: nothing to make


async def test_a_hopper_gpu_out_of_mig_mode_is_partitioned_and_its_whole_gpu_is_itself() -> None:
    async with dra_harness(mig=True, mig_enabled=False, publish="dynamic-mig") as h:
        await h.kubelet().register()
        gate = h.m.driver.gate
        assert gate.modes()[h.gpu(0)].effective is PublishMode.DYNAMIC_MIG
        assert gate.devices_by_name()["gpu-0"].partition is None  # the GPU itself
        whole = h.claims.add("whole", result("gpu-0"))
        (device,) = answer(await h.prepare(whole), whole.uid)
        assert device[3] == (f"{KIND}={whole.uid}-{h.gpu(0)}",)
        assert h.mig is not None and h.mig.count() == 0
        # on another GPU, the first partition switches MIG mode on; the last one going, off again
        part = h.claims.add("part", result("gpu-1-mig-1g10gb-19-0"))
        answer(await h.prepare(part), part.uid)
        assert h.inventory.gpus[1].mig_enabled and placements(h, 1) == [(0, 1)]
        assert gate.devices_by_name()["gpu-1"].partition is not None  # in MIG mode: the 7g instance
        await h.unprepare(part)
        assert not h.inventory.gpus[1].mig_enabled


async def test_instances_someone_else_made_are_offered_as_they_are(h: DraHarness) -> None:
    assert h.mig is not None
    foreign = h.mig.add_foreign(h.gpu(0), 9, 4)  # an operator's 3g.40gb at slices 4-7
    await h.reload()
    names = {d.name for d in h.m.driver.gate.devices() if d.gpu_uuid == h.gpu(0)}
    static = f"gpu-0-mig-{foreign.gpu_instance_id}-0"
    assert static in names  # the existing MIG device, as whole mode offers it
    assert "gpu-0" not in names and THREE_G.format(4) not in names and ONE_G.format(5) not in names
    assert {THREE_G.format(0), ONE_G.format(3)} <= names
    assert "are offered as they are" in h.m.driver.gate.modes()[h.gpu(0)].note
    ref = h.claims.add("theirs", result(static))
    assert answer(await h.prepare(ref), ref.uid)[0][3] == (f"{KIND}={ref.uid}-{foreign.uuid}",)
    await h.unprepare(ref)
    assert foreign in h.mig.instances_by_gpu[h.gpu(0)]  # never destroyed: not the agent's


async def test_readiness_says_why_a_gpu_is_not_published_as_wished() -> None:
    async with dra_harness(mig=True, mig_enabled=False, mig_architecture="ampere", publish="dynamic-mig") as h:
        await h.kubelet().register()
        ready = h.m.readiness()
        assert ready.ok and "dra.publish: a GPU is whole where dynamic-mig is wished" in ready.detail
        assert "(and 7 more GPUs)" in ready.detail and "not in MIG mode" in ready.detail


async def test_a_recorded_instance_someone_destroyed_is_forgotten_not_destroyed_again(h: DraHarness) -> None:
    """Its IDs may name someone else's instance by now: the clean-up checks the UUID first."""
    assert h.mig is not None
    ref = h.claims.add("a", result(ONE_G.format(0)))
    await h.prepare(ref)
    await h.stop()
    (ours,) = h.mig.instances_by_gpu[h.gpu(0)]
    h.mig.instances_by_gpu[h.gpu(0)].clear()  # destroyed behind the agent's back...
    h.mig._ids = iter([ours.gpu_instance_id])  # type: ignore[assignment]
    theirs = h.mig.add_foreign(h.gpu(0), 19, 3)  # ...and its GPU instance ID given to another
    store = CheckpointStore(h.config.state_dir)
    loaded = store.load()
    store.write([], boot_id=h.boot_id, instances=loaded.instances)  # the claim went while the agent was down
    await h.reload()
    await h.restart()
    assert h.mig.instances_by_gpu[h.gpu(0)] == [theirs]
    assert instances(h) == []


async def test_an_instance_gone_behind_the_agents_back_does_not_stop_the_cdi_reconciler(h: DraHarness) -> None:
    """Seen on the real peers: the simulated node loses its instances with the agent's process.
    The claim spec that named it goes; CDI stays ready; the unprepare still succeeds."""
    assert h.mig is not None and h.cdi is not None
    ref = h.claims.add("a", result(ONE_G.format(0)))
    await h.prepare(ref)
    h.mig.instances_by_gpu[h.gpu(0)].clear()
    await h.reload()
    report = await h.cdi.reconcile_once()
    assert report.errors == () and h.cdi.last_pass_ok()[0]
    assert ref.uid not in h.claim_specs()
    assert (await h.unprepare(ref)).claims[ref.uid].error == ""


async def test_a_whole_gpu_claim_waits_for_the_partitions_and_gets_the_gpu_itself() -> None:
    """As on the real peers: the whole GPU is allocated the moment the partitions' pod is deleted.
    The prepare waits for their unprepare, and is planned again: the last instance gone, the GPU is
    out of MIG mode, and the claim gets the GPU itself, not a 7g instance."""
    tuning = dataclasses.replace(FAST, timeouts=PrepareTimeouts(api_s=0.3, lock_s=1.0, held_s=5.0))
    async with dra_harness(mig=True, mig_enabled=False, publish="dynamic-mig", tuning=tuning) as h:
        await h.kubelet().register()
        parts = h.claims.add("parts", *(result(ONE_G.format(i), request=f"r{i}") for i in range(7)))
        answer(await h.prepare(parts), parts.uid)
        assert h.inventory.gpus[0].mig_enabled
        whole = h.claims.add("whole", result("gpu-0"))
        waiting = asyncio.ensure_future(h.prepare(whole))
        await wait_for(lambda: whole in h.claims.calls, what="the whole-GPU claim read")
        await asyncio.sleep(0)
        assert not waiting.done()
        await h.unprepare(parts)
        (device,) = answer(await waiting, whole.uid)
        assert device[3] == (f"{KIND}={whole.uid}-{h.gpu(0)}",) and not h.inventory.gpus[0].mig_enabled
