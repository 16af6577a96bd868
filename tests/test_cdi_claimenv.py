"""Extra environment of a prepared DRA claim: written with its spec, kept by the reconciler."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.cdi import spec as s
from agent.cdi import writer
from agent.cdi.claimenv import ClaimDevices, as_claim_devices
from agent.cdi.errors import CdiError, InvalidNameError, InvalidSpecError, SpecConflictError
from tests.cdi_fixtures import FakeDriver, inventory, prepare_claim
from tests.test_cdi_service import CLAIM_FILE, UID, load, make_service


@pytest.fixture
def driver(tmp_path: Path) -> FakeDriver:
    return FakeDriver(tmp_path / "driver", cap_minors=(21, 22)).build()


async def test_env_goes_to_the_claimed_device_only(tmp_path: Path, driver: FakeDriver) -> None:
    service = make_service(tmp_path, driver, CollectorRegistry())
    g0, g1 = inventory(2).gpus
    names = await prepare_claim(service, UID, [g0.uuid, g1.uuid], env={g1.uuid: ["A=1", "B=two words"]})
    spec = load(tmp_path / "cdi" / CLAIM_FILE)
    assert s.validate(spec) == [] and spec.qualified_names() == tuple(names)
    assert "A=1" not in spec.devices[0].container_edits.env
    assert spec.devices[1].container_edits.env[-2:] == ("A=1", "B=two words")


async def test_reconciler_keeps_the_env_and_recreates_it(tmp_path: Path, driver: FakeDriver) -> None:
    service = make_service(tmp_path, driver, CollectorRegistry())
    g0 = inventory(2).gpus[0]
    checkpoint = {UID: ClaimDevices(devices=(g0.uuid,), env={g0.uuid: ("A=1",)})}
    service.set_prepared_claims(lambda: checkpoint)
    await prepare_claim(service, UID, [g0.uuid], env={g0.uuid: ["A=1"]})
    before = (tmp_path / "cdi" / CLAIM_FILE).read_bytes()
    report = await service.reconcile_once()
    assert report.errors == () and [r for r in report.repairs if r.file == CLAIM_FILE] == []
    (tmp_path / "cdi" / CLAIM_FILE).unlink()  # a reboot emptied the tmpfs
    report = await service.reconcile_once()
    assert [r.action for r in report.repairs] == ["created"]
    assert (tmp_path / "cdi" / CLAIM_FILE).read_bytes() == before


async def test_entries_the_device_already_has_are_not_repeated(tmp_path: Path, driver: FakeDriver) -> None:
    service = make_service(tmp_path, driver, CollectorRegistry())
    g0 = inventory(2).gpus[0]
    await prepare_claim(service, UID, [g0.uuid], env={g0.uuid: ["A=1"]})
    on_disk = load(tmp_path / "cdi" / CLAIM_FILE).devices[0].container_edits.env
    # what a rebuild reads back from disk (driver entries included) writes the same file
    before = (tmp_path / "cdi" / CLAIM_FILE).read_bytes()
    await prepare_claim(service, UID, [g0.uuid], env={g0.uuid: list(on_disk)})
    assert (tmp_path / "cdi" / CLAIM_FILE).read_bytes() == before


async def test_invalid_entry_is_a_cdi_error_and_writes_nothing(tmp_path: Path, driver: FakeDriver) -> None:
    service = make_service(tmp_path, driver, CollectorRegistry())
    g0 = inventory(2).gpus[0]
    with pytest.raises(InvalidSpecError, match="invalid environment variable"):
        await prepare_claim(service, UID, [g0.uuid], env={g0.uuid: ["=nope"]})
    assert not (tmp_path / "cdi" / CLAIM_FILE).exists()


def test_plain_device_lists_still_work() -> None:
    assert as_claim_devices(["a", "b"]) == ClaimDevices(devices=("a", "b"))


# --- batches ------------------------------------------------------------------------------


async def test_a_batch_writes_every_claim_and_fails_per_claim(tmp_path: Path, driver: FakeDriver) -> None:
    service = make_service(tmp_path, driver, CollectorRegistry())
    g0, g1 = inventory(2).gpus
    other = "0e3f1a2b-aaaa-bbbb-cccc-000000000002"
    out = await service.prepare_claims(
        {
            UID: ClaimDevices(devices=(g0.uuid,)),
            other: ClaimDevices(devices=(g1.uuid,), env={g1.uuid: ("A=1",)}),
            "bad/uid": ClaimDevices(devices=(g0.uuid,)),
            "0e3f1a2b-empty": ClaimDevices(devices=()),
            "0e3f1a2b-unknown": ClaimDevices(devices=("GPU-not-here",)),
        }
    )
    assert out[UID] == [f"k8s.gpu-node-agent.nvidia.com/claim={UID}-{g0.uuid}"]
    assert isinstance(out["bad/uid"], InvalidNameError)
    assert isinstance(out["0e3f1a2b-empty"], CdiError) and "no devices" in str(out["0e3f1a2b-empty"])
    assert isinstance(out["0e3f1a2b-unknown"], CdiError) and "not on this node" in str(out["0e3f1a2b-unknown"])
    assert sorted(p.name for p in (tmp_path / "cdi").glob("*claim_*")) == sorted(
        [CLAIM_FILE, f"k8s.gpu-node-agent.nvidia.com-claim_{other}.json"]
    )
    assert (
        load(tmp_path / "cdi" / f"k8s.gpu-node-agent.nvidia.com-claim_{other}.json").devices[0].container_edits.env[-1]
        == "A=1"
    )
    removed = await service.unprepare_claims([UID, other, "never-prepared", "bad/uid"])
    assert removed[UID] is None and removed[other] is None and removed["never-prepared"] is None
    assert isinstance(removed["bad/uid"], InvalidNameError)
    assert list((tmp_path / "cdi").glob("*claim_*")) == []


async def test_a_batch_lists_the_directory_once_for_its_conflict_checks(
    tmp_path: Path, driver: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = make_service(tmp_path, driver, CollectorRegistry())
    g0, g1 = inventory(2).gpus
    await prepare_claim(service, UID, [g0.uuid])
    listings = []
    real = writer.spec_files
    monkeypatch.setattr(writer, "spec_files", lambda d: listings.append(d) or real(d))
    others = [f"0e3f1a2b-aaaa-bbbb-cccc-00000000001{i}" for i in range(4)]
    out = await service.prepare_claims({uid: ClaimDevices(devices=(g1.uuid,)) for uid in others})
    assert all(isinstance(v, list) for v in out.values()) and len(listings) == 1
    # the check still sees what others put there since: a foreign copy of a claim's names is refused
    foreign = tmp_path / "cdi" / "someone.json"
    foreign.write_bytes((tmp_path / "cdi" / f"k8s.gpu-node-agent.nvidia.com-claim_{others[0]}.json").read_bytes())
    (tmp_path / "cdi" / f"k8s.gpu-node-agent.nvidia.com-claim_{others[0]}.json").unlink()
    out = await service.prepare_claims({others[0]: ClaimDevices(devices=(g1.uuid,))})
    assert isinstance(out[others[0]], SpecConflictError)


async def test_the_conflict_check_rereads_a_file_that_changed(tmp_path: Path, driver: FakeDriver) -> None:
    service = make_service(tmp_path, driver, CollectorRegistry())
    g0, g1 = inventory(2).gpus
    await prepare_claim(service, UID, [g0.uuid])  # the directory's files are now known
    foreign = tmp_path / "cdi" / "someone.json"
    other = "0e3f1a2b-aaaa-bbbb-cccc-000000000002"
    spec = s.Spec.at_minimum_version(
        kind="k8s.gpu-node-agent.nvidia.com/claim",
        devices=(s.Device(f"{other}-{g1.uuid}", s.ContainerEdits(env=("X=1",))),),
    )
    foreign.write_text(s.dumps(replace_name(spec, "unrelated")))
    await prepare_claim(service, "0e3f1a2b-aaaa-bbbb-cccc-000000000003", [g1.uuid])  # reads and caches it
    foreign.write_text(s.dumps(spec))  # edited in place: now it defines the next claim's name
    with pytest.raises(SpecConflictError, match=r"someone\.json already defines"):
        await prepare_claim(service, other, [g1.uuid])


def replace_name(spec: s.Spec, name: str) -> s.Spec:
    from dataclasses import replace

    return replace(spec, devices=(replace(spec.devices[0], name=name),))
