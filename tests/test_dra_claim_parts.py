"""The parts the DRA driver is made of, each alone: the prepared claims and their checkpoint
writes, the device reservations, the per-claim locks. The driver's behaviour as a whole is in
test_dra_prepare.py, test_dra_restart.py and test_dra_concurrency.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.dra.claims.checkpoint import CheckpointStore, PreparedClaim, PreparedDevice
from agent.dra.claims.errors import ClaimError, Reason
from agent.dra.claims.locks import ClaimLocks
from agent.dra.claims.plan import PlannedDevice
from agent.dra.claims.prepared import PreparedClaims
from agent.dra.claims.reservations import Reservations
from agent.dra.devices import DraDevice
from agent.dra.metrics import DraMetrics
from agent.kube.claims.model import ClaimRef
from tests.dra_fakes import NODE, result

NOW = "2026-12-01T10:00:00.000Z"


def claim(uid: str, *devices: tuple[str, str], admin: bool = False) -> PreparedClaim:
    """A prepared claim holding (device UUID, GPU UUID) pairs."""
    held = tuple(
        PreparedDevice(NODE, uuid.lower(), uuid, gpu, ("gpu",), None, (), admin_access=admin) for uuid, gpu in devices
    )
    return PreparedClaim(namespace="ns", name=uid, uid=uid, devices=held, prepared_at=NOW)


def planned(uuid: str, gpu: str, *, admin: bool = False) -> PlannedDevice:
    device = DraDevice(name=uuid.lower(), uuid=uuid, gpu_uuid=gpu, is_mig=uuid != gpu, attributes={}, capacity={})
    return PlannedDevice(result=result(device.name, admin=admin), device=device)


def ref(uid: str) -> ClaimRef:
    return ClaimRef(namespace="ns", name=uid, uid=uid)


# --- the prepared claims --------------------------------------------------------------------


def prepared_claims(tmp_path: Path) -> PreparedClaims:
    return PreparedClaims(CheckpointStore(tmp_path), boot_id="b", metrics=DraMetrics(CollectorRegistry()))


async def test_changes_made_before_a_write_share_it(tmp_path: Path) -> None:
    claims = prepared_claims(tmp_path)
    await claims.restore(dict)
    claims.record(claim("a", ("GPU-0", "GPU-0")))
    claims.record(claim("b", ("GPU-1", "GPU-1")))
    await asyncio.gather(claims.persist(), claims.persist())  # two batches, one write
    assert claims.checkpoint.writes == 1
    await claims.persist()  # nothing new: no write
    assert claims.checkpoint.writes == 1
    assert claims.remove("a") is not None and claims.remove("a") is None
    await claims.persist()
    assert claims.checkpoint.writes == 2
    assert set(CheckpointStore(tmp_path).load().claims) == {"b"} == set(claims)


async def test_a_corrupt_checkpoint_is_rebuilt_and_written_back(tmp_path: Path) -> None:
    (tmp_path / "checkpoint.json").write_text("{")
    claims = prepared_claims(tmp_path)
    await claims.restore(lambda: {"a": claim("a", ("GPU-0", "GPU-0"))})
    assert claims.loaded and set(claims) == {"a"}
    assert claims.checkpoint.loaded == "corrupt" and claims.checkpoint.rebuilt_claims == 1
    assert claims.checkpoint.writes == 1 and set(CheckpointStore(tmp_path).load().claims) == {"a"}


# --- reservations -----------------------------------------------------------------------------


def test_a_device_held_or_reserved_is_not_reserved_again() -> None:
    prepared = {"a": claim("a", ("GPU-0", "GPU-0"))}
    reservations = Reservations(prepared)
    with pytest.raises(ClaimError, match=r"device gpu-0 is already prepared for claim ns/a \(a\)") as held:
        reservations.reserve(ref("x"), [planned("GPU-0", "GPU-0")])
    assert held.value.reason is Reason.IN_USE
    reservations.reserve(ref("b"), [planned("MIG-1", "GPU-1")])
    with pytest.raises(ClaimError, match="being prepared for claim b"):  # the whole GPU holds its MIG devices
        reservations.reserve(ref("c"), [planned("GPU-1", "GPU-1")])
    reservations.reserve(ref("d"), [planned("MIG-2", "GPU-1")])  # another MIG device of the same GPU is free
    assert [r.uid for r, _ in reservations.in_preparation()] == ["b", "d"] and len(reservations) == 2
    reservations.release("b")
    reservations.release("b")
    assert [r.uid for r, _ in reservations.in_preparation()] == ["d"]


def test_admin_access_shares_a_device_with_any_claim() -> None:
    reservations = Reservations({"a": claim("a", ("GPU-0", "GPU-0"))})
    reservations.reserve(ref("monitor"), [planned("GPU-0", "GPU-0", admin=True)])
    assert len(reservations) == 1


# --- locks ------------------------------------------------------------------------------------


async def test_a_claim_another_call_holds_is_busy_past_the_deadline_and_locks_go_when_unused() -> None:
    locks = ClaimLocks(timeout_s=0.0)
    async with locks.hold([ref("b"), ref("a")]) as (held, busy):
        assert [r.uid for r in held] == ["b", "a"] and busy == []  # in call order
        async with locks.hold([ref("a"), ref("c")]) as (again, busy):
            assert [r.uid for r in again] == ["c"] and [r.uid for r in busy] == ["a"]
    assert locks._locks == {} and locks._users == {}
