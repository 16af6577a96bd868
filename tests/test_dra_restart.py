"""Restarts: prepared claims survive the agent, a lost checkpoint is rebuilt, a crash mid-batch
leaves nothing half done. Each restart builds a new mechanism and CDI service on the same
directories, as a new agent process would."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.dra.claims.checkpoint import FILE_NAME, CheckpointError, CheckpointStore
from agent.kube.claims.model import ClaimRef
from tests.checkpoint_files import put_content
from tests.disk_ops import record_disk_ops
from tests.dra_fakes import DraHarness, answer, dra_harness, gpu_config, opaque, result
from tests.test_plugin_fakes import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
async def h() -> AsyncIterator[DraHarness]:
    async with dra_harness() as harness:
        await harness.kubelet().register()
        yield harness


def spec_bytes(h: DraHarness) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(h.cdi_root.glob("*claim_*.json"))}


def checkpoint_uids(h: DraHarness) -> set[str]:
    return {c["uid"] for c in json.loads(h.checkpoint.read_text())["data"]["claims"]}


async def reconciled(h: DraHarness) -> None:
    """What the CDI reconciler's first pass does in the new process."""
    assert h.cdi is not None
    report = await h.cdi.reconcile_once()
    assert report.errors == ()


async def two_claims(h: DraHarness) -> tuple[ClaimRef, ClaimRef, dict[str, Any]]:
    a = h.claims.add("a", result("gpu-0"), configs=[opaque(gpu_config({"NCCL_DEBUG": "INFO"}))])
    b = h.claims.add("b", result("gpu-1"), result("gpu-2", request="x/y"))
    response = await h.prepare(a, b)
    return a, b, {a.uid: answer(response, a.uid), b.uid: answer(response, b.uid)}


async def test_prepared_claims_survive_a_restart(h: DraHarness) -> None:
    a, b, answers = await two_claims(h)
    await h.restart()
    await reconciled(h)
    h.claims.down = "API server unreachable"
    response = await h.prepare(a, b, api="v1beta1")
    assert {uid: answer(response, uid) for uid in answers} == answers
    assert h.claim_specs() == {a.uid, b.uid}
    checkpoint = h.m.debug_state()["checkpoint"]
    assert checkpoint["loaded"] == "ok" and checkpoint["version"] == 2  # type: ignore[index]


async def test_a_prepare_fsyncs_the_checkpoint_not_the_claim_specs(
    h: DraHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint is the durable record; the claim specs it lists are rebuilt from it."""
    await h.prepare(h.claims.add("first", result("gpu-1")))  # the first write makes the slots file
    ops = record_disk_ops(monkeypatch, Path(os.path.commonpath([h.cdi_root, h.checkpoint])))
    ref = h.claims.add("a", result("gpu-0"))
    await h.prepare(ref)
    spec = f"k8s.gpu-node-agent.nvidia.com-claim_{ref.uid}.json"
    slots = FILE_NAME + ".slots"
    # the spec and the checkpoint are written at once (two worker threads): each in its own order
    assert sorted(ops) == sorted(
        [
            ("write", spec),
            ("rename", spec),
            ("write", slots),  # in place, in the slot the last write did not use
            ("fdatasync", slots),
            ("write", FILE_NAME),  # the copy for people and tools, after the record is durable
            ("rename", FILE_NAME),
        ]
    )
    assert [op for op in ops if op[1] == spec] == [("write", spec), ("rename", spec)]
    assert [op for op in ops if op[1] != spec] == [
        ("write", slots),
        ("fdatasync", slots),
        ("write", FILE_NAME),
        ("rename", FILE_NAME),
    ]
    ops.clear()
    await h.unprepare(ref)
    assert ops == [("write", slots), ("fdatasync", slots), ("write", FILE_NAME), ("rename", FILE_NAME)]


@pytest.mark.parametrize("loss", ["empty", "missing", "other-content"])
async def test_claim_specs_a_power_loss_damaged_are_rebuilt_from_the_checkpoint(h: DraHarness, loss: str) -> None:
    """Unsynced claim specs on a CDI directory on disk may come back empty, missing or old."""
    a, b, answers = await two_claims(h)
    before = spec_bytes(h)
    spec = h.cdi_root / f"k8s.gpu-node-agent.nvidia.com-claim_{a.uid}.json"
    await h.stop()
    if loss == "empty":
        spec.write_bytes(b"")
    elif loss == "missing":
        spec.unlink()
    else:
        spec.write_bytes(before[f"k8s.gpu-node-agent.nvidia.com-claim_{b.uid}.json"])
    await h.restart()
    await reconciled(h)
    assert spec_bytes(h) == before
    response = await h.prepare(a, b)
    assert {uid: answer(response, uid) for uid in answers} == answers


@pytest.mark.parametrize("damage", ["truncate", "edit", "newer-version"])
async def test_an_unusable_checkpoint_is_rebuilt_from_the_cdi_specs(h: DraHarness, damage: str) -> None:
    a, b, answers = await two_claims(h)
    specs = spec_bytes(h)
    raw = h.checkpoint.read_bytes()
    put_content(
        h.checkpoint,
        {
            "truncate": raw[:100],
            "edit": raw.replace(b'"gpu-1"', b'"gpu-6"'),
            "newer-version": raw.replace(b'"version":2', b'"version":7'),
        }[damage],
    )
    await h.restart()  # no crash loop: it starts
    state = h.m.debug_state()["checkpoint"]
    assert state["loaded"] == "corrupt" and state["rebuilt_claims"] == 2  # type: ignore[index]
    assert "checkpoint.json.corrupt-" in state["corrupt_moved_aside"]["moved_to"]  # type: ignore[index]
    assert h.metric("gpu_agent_dra_checkpoint_corruptions_total") == 1.0
    assert checkpoint_uids(h) == {a.uid, b.uid}  # the rebuilt checkpoint is on disk at once
    await reconciled(h)
    assert spec_bytes(h) == specs  # the specs (with the claim's env) stay exactly as they were
    holders = h.m.usage().holders[h.gpu(1)]
    assert holders[0].uid == b.uid and holders[0].name == ""  # not known from a spec
    # the kubelet prepares again after the restart: the same answer, completed from the API
    response = await h.prepare(a, b)
    assert {uid: answer(response, uid) for uid in answers} == answers
    assert h.m.usage().holders[h.gpu(1)][0].name == "b"
    # and a rebuilt claim can be unprepared
    assert (await h.unprepare(a)).claims[a.uid].error == ""
    assert h.claim_specs() == {b.uid} and checkpoint_uids(h) == {b.uid}
    assert h.m.readiness().ok


async def test_a_rebuilt_claim_still_blocks_its_devices(h: DraHarness) -> None:
    a, _, _ = await two_claims(h)
    put_content(h.checkpoint, b"{")
    await h.restart()
    thief = h.claims.add("thief", result("gpu-0"))
    error = (await h.prepare(thief)).claims[thief.uid].error
    assert f"already prepared for claim ({a.uid})" in error


async def test_a_checkpoint_from_an_earlier_boot_keeps_its_claims_and_specs(h: DraHarness) -> None:
    a, b, answers = await two_claims(h)
    specs = spec_bytes(h)
    for path in h.cdi_root.iterdir():  # a reboot empties the tmpfs /var/run/cdi
        path.unlink()
    await h.restart(boot_id="boot-2")
    assert h.m.debug_state()["checkpoint"]["from_earlier_boot"] is True  # type: ignore[index]
    await reconciled(h)
    assert spec_bytes(h) == specs
    response = await h.prepare(a, b)
    assert {uid: answer(response, uid) for uid in answers} == answers
    assert (await h.unprepare(a, b)).claims[b.uid].error == ""
    assert h.claim_specs() == set()


async def test_a_failed_checkpoint_write_fails_the_batch_and_leaves_nothing(
    h: DraHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = h.claims.add("first", result("gpu-3"))
    await h.prepare(first)

    def broken(self: CheckpointStore, *args: Any, **kwargs: Any) -> str:
        raise CheckpointError(f"cannot write {self.path}: no space left on device")

    monkeypatch.setattr(CheckpointStore, "write", broken)
    refs = [h.claims.add(f"c{i}", result(f"gpu-{i}")) for i in range(3)]
    response = await h.prepare(*refs)
    for ref in refs:
        assert "no space left on device" in response.claims[ref.uid].error
    assert h.claim_specs() == {first.uid}
    assert h.metric("gpu_agent_dra_claim_errors_total", operation="prepare", reason="checkpoint-error") == 3.0
    assert "no space left" in h.m.debug_state()["checkpoint"]["last_error"]  # type: ignore[index]
    # an unprepare that cannot be recorded keeps the claim (the kubelet retries)
    assert "no space left" in (await h.unprepare(first)).claims[first.uid].error
    assert first.uid in h.m.driver.prepared
    monkeypatch.undo()
    assert all(e.error == "" for e in (await h.prepare(*refs)).claims.values())  # the devices are free
    assert (await h.unprepare(first)).claims[first.uid].error == ""


async def test_a_claim_whose_spec_fails_is_not_in_the_checkpoint_written_beside_it(h: DraHarness) -> None:
    """The checkpoint is written while the specs are: a claim whose spec write failed is taken out
    of it again before the answer, and its devices are free; the rest of the batch is prepared."""
    good, bad = h.claims.add("good", result("gpu-0")), h.claims.add("bad", result("gpu-1"))
    foreign = {  # another file already defines the name the bad claim's device would get
        "cdiVersion": "0.5.0",
        "kind": "k8s.gpu-node-agent.nvidia.com/claim",
        "devices": [{"name": f"{bad.uid}-{h.gpu(1)}", "containerEdits": {"env": ["X=1"]}}],
    }
    h.cdi_root.mkdir(parents=True, exist_ok=True)
    (h.cdi_root / "someone.json").write_text(json.dumps(foreign))
    response = await h.prepare(good, bad)
    assert response.claims[good.uid].error == ""
    assert "someone.json already defines" in response.claims[bad.uid].error
    assert checkpoint_uids(h) == {good.uid} and set(h.m.driver.prepared) == {good.uid}
    assert h.claim_specs() == {good.uid}
    (h.cdi_root / "someone.json").unlink()
    assert (await h.prepare(bad)).claims[bad.uid].error == ""  # its GPU was never held
    assert checkpoint_uids(h) == {good.uid, bad.uid} == h.claim_specs()


# --- a crash in the middle of a batch --------------------------------------------------------


class Gate:
    """Stops a coroutine or a worker thread at one point until released (or forever)."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.release = threading.Event()

    def hold(self) -> None:
        self.reached.set()
        self.release.wait(10)


def _hook_cdi(h: DraHarness, gate: Gate) -> None:
    """After the claim's CDI spec is written, before the driver records it."""
    assert h.cdi is not None
    real = h.cdi.prepare_claims

    async def prepare_claims(*args: Any, **kwargs: Any) -> Any:
        names = await real(*args, **kwargs)
        gate.reached.set()
        await asyncio.Event().wait()  # the process "dies" here
        return names

    h.cdi.prepare_claims = prepare_claims  # type: ignore[method-assign]


def _hook_checkpoint_commit(after: bool, gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the checkpoint record is written into its slot, or after it is synced and before
    the copy ``checkpoint.json`` is replaced (in the write's worker thread)."""
    real_pwrite, real_rename = os.pwrite, os.rename

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        if not after and os.readlink(f"/proc/self/fd/{fd}").endswith(FILE_NAME + ".slots"):
            gate.hold()
            raise SystemExit("crashed")  # the record is never written
        return real_pwrite(fd, data, offset)

    def rename(src: Any, dst: Any, **kwargs: Any) -> None:
        if after and Path(dst).name == FILE_NAME:
            gate.hold()
            raise SystemExit("crashed")  # the record is durable, the copy is not replaced
        return real_rename(src, dst, **kwargs)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "rename", rename)


@pytest.mark.parametrize("point", ["after-cdi-write", "before-commit", "after-commit"])
async def test_a_crash_mid_batch_leaves_no_orphan_or_missing_spec(
    h: DraHarness, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    done, _, answers_before = await two_claims(h)
    refs = [h.claims.add(f"c{i}", result(f"gpu-{i + 3}")) for i in range(3)]
    gate = Gate()
    if point == "after-cdi-write":
        _hook_cdi(h, gate)
    else:
        _hook_checkpoint_commit(point == "after-commit", gate, monkeypatch)
    call = asyncio.create_task(h.prepare(*refs))
    await wait_for(gate.reached.is_set, what=f"the batch reaching {point}")
    await h.stop()  # the agent dies with the batch half done
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    gate.release.set()
    monkeypatch.undo()

    await h.restart()
    await reconciled(h)
    on_disk = checkpoint_uids(h)
    assert h.claim_specs() == on_disk  # no orphaned spec, no missing one
    expected = {done.uid} | ({r.uid for r in refs} if point == "after-commit" else set())
    assert on_disk >= expected and h.m.debug_state()["checkpoint"]["loaded"] == "ok"  # type: ignore[index]
    # the kubelet retries the batch: everything is prepared, with the answers a clean run gives
    response = await h.prepare(done, *refs)
    assert answer(response, done.uid) == answers_before[done.uid]
    for i, ref in enumerate(refs):
        uuid = h.gpu(i + 3)
        assert answer(response, ref.uid) == [
            (("gpu",), "node-a", f"gpu-{i + 3}", (f"k8s.gpu-node-agent.nvidia.com/claim={ref.uid}-{uuid}",))
        ]
    await reconciled(h)
    assert h.claim_specs() == checkpoint_uids(h) == {done.uid, *answers_before, *(r.uid for r in refs)}
