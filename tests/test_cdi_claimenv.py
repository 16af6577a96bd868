"""Extra environment of a prepared DRA claim: written with its spec, kept by the reconciler."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.cdi import spec as s
from agent.cdi.claimenv import ClaimDevices, as_claim_devices
from agent.cdi.errors import InvalidSpecError
from tests.cdi_fixtures import FakeDriver, inventory
from tests.test_cdi_service import CLAIM_FILE, UID, load, make_service


@pytest.fixture
def driver(tmp_path: Path) -> FakeDriver:
    return FakeDriver(tmp_path / "driver", cap_minors=(21, 22)).build()


async def test_env_goes_to_the_claimed_device_only(tmp_path: Path, driver: FakeDriver) -> None:
    service = make_service(tmp_path, driver, CollectorRegistry())
    g0, g1 = inventory(2).gpus
    names = await service.prepare_claim(UID, [g0.uuid, g1.uuid], env={g1.uuid: ["A=1", "B=two words"]})
    spec = load(tmp_path / "cdi" / CLAIM_FILE)
    assert s.validate(spec) == [] and spec.qualified_names() == tuple(names)
    assert "A=1" not in spec.devices[0].container_edits.env
    assert spec.devices[1].container_edits.env[-2:] == ("A=1", "B=two words")


async def test_reconciler_keeps_the_env_and_recreates_it(tmp_path: Path, driver: FakeDriver) -> None:
    service = make_service(tmp_path, driver, CollectorRegistry())
    g0 = inventory(2).gpus[0]
    checkpoint = {UID: ClaimDevices(devices=(g0.uuid,), env={g0.uuid: ("A=1",)})}
    service.set_prepared_claims(lambda: checkpoint)
    await service.prepare_claim(UID, [g0.uuid], env={g0.uuid: ["A=1"]})
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
    await service.prepare_claim(UID, [g0.uuid], env={g0.uuid: ["A=1"]})
    on_disk = load(tmp_path / "cdi" / CLAIM_FILE).devices[0].container_edits.env
    # what a rebuild reads back from disk (driver entries included) writes the same file
    before = (tmp_path / "cdi" / CLAIM_FILE).read_bytes()
    await service.prepare_claim(UID, [g0.uuid], env={g0.uuid: list(on_disk)})
    assert (tmp_path / "cdi" / CLAIM_FILE).read_bytes() == before


async def test_invalid_entry_is_a_cdi_error_and_writes_nothing(tmp_path: Path, driver: FakeDriver) -> None:
    service = make_service(tmp_path, driver, CollectorRegistry())
    g0 = inventory(2).gpus[0]
    with pytest.raises(InvalidSpecError, match="invalid environment variable"):
        await service.prepare_claim(UID, [g0.uuid], env={g0.uuid: ["=nope"]})
    assert not (tmp_path / "cdi" / CLAIM_FILE).exists()


def test_plain_device_lists_still_work() -> None:
    assert as_claim_devices(["a", "b"]) == ClaimDevices(devices=("a", "b"))
