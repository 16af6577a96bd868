"""One pass that makes the agent's spec files match the host.

The desired state is computed from scratch each pass (inventory + a fresh look at the
driver from the service's DriverSource, installed or simulated + the prepared claims); the
files the agent owns are then compared byte for byte with it: a missing file is created
(the CDI directory is usually a tmpfs that a reboot empties), a differing one rewritten
(corrupt, edited, or made for another driver version or other device numbers), and an
owned file nothing wants is deleted (an orphan claim spec, or the device plugin spec of a
node whose GPUs are gone). A simulated driver has no device nodes to check; its specs
change only with the inventory. Errors are collected per file so one bad file does not
stop the others. Blocking: run it in a worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

import structlog

from agent.cdi import generate
from agent.cdi import spec as cdi_spec
from agent.cdi.claimenv import ClaimDevices, as_claim_devices, with_env
from agent.cdi.driversource import DriverSource
from agent.cdi.errors import CdiError, InvalidSpecError
from agent.cdi.generate import DriverView
from agent.cdi.names import claim_uid_of, spec_file_name, transient_spec_file_name
from agent.cdi.writer import SpecWriter
from agent.core.inventory.model import Inventory

log = structlog.get_logger("agent.cdi")

Action = Literal["created", "rewritten", "deleted"]
ACTIONS: tuple[Action, ...] = ("created", "rewritten", "deleted")


@dataclass(frozen=True, slots=True)
class Repair:
    action: Action
    file: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"action": self.action, "file": self.file, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class ReconcileReport:
    at: str  # ISO 8601 UTC
    repairs: tuple[Repair, ...] = ()
    errors: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()  # devices left out of specs (nodes missing)
    driver_version: str | None = None
    owned: tuple[str, ...] = ()  # the agent's files after the pass
    names: Mapping[str, str] = field(default_factory=dict)  # device plugin names of this pass


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


@dataclass(frozen=True, slots=True)
class Desired:
    files: dict[str, cdi_spec.Spec]
    names: dict[str, str]
    skipped: tuple[str, ...]
    errors: tuple[str, ...]


def desired_state(
    *,
    device_plugin_kind: str,
    claim_kind: str,
    inventory: Inventory,
    claims: Mapping[str, Sequence[str] | ClaimDevices],
    driver: DriverView,
) -> Desired:
    """Pure: every file the agent should own, by name."""
    files: dict[str, cdi_spec.Spec] = {}
    skipped: list[str] = []
    errors: list[str] = []
    plugin = generate.device_plugin_spec(device_plugin_kind, inventory, driver)
    skipped += plugin.skipped
    if plugin.spec is not None:
        files[spec_file_name(device_plugin_kind)] = plugin.spec
    for uid, value in sorted(claims.items()):
        claimed = as_claim_devices(value)
        try:
            # a device gone from the node (a MIG instance destroyed behind the agent's back) is left
            # out of the spec, not an error that would keep every other spec from being written
            generated = generate.claim_spec(claim_kind, uid, claimed.devices, inventory, driver, skip_unknown=True)
            claim = with_env(generated, claimed.env, claimed.mounts)
            name = transient_spec_file_name(claim_kind, uid)
        except CdiError as exc:
            errors.append(f"claim {uid}: {exc}")
            continue
        skipped += claim.skipped
        if claim.spec is not None:
            files[name] = claim.spec
    return Desired(files=files, names=dict(plugin.names), skipped=tuple(skipped), errors=tuple(errors))


class Reconciler:
    def __init__(self, *, writer: SpecWriter, source: DriverSource, device_plugin_kind: str, claim_kind: str) -> None:
        self.writer = writer
        self.source = source
        self.device_plugin_kind = device_plugin_kind
        self.claim_kind = claim_kind
        #: the inventory and the driver the last pass looked at; None when it did not look or failed
        self.looked: tuple[Inventory, DriverView] | None = None

    def discover(self, inventory: Inventory) -> DriverView:
        return self.source.look(inventory)

    def reconcile(
        self,
        inventory: Inventory,
        claims: Mapping[str, Sequence[str] | ClaimDevices],
        *,
        keep_claim_files: bool = False,
    ) -> ReconcileReport:
        """Bring the directory in line; ``keep_claim_files``: which claims are prepared is not
        known (the DRA checkpoint cannot be read), so no claim spec is deleted."""
        repairs: list[Repair] = []
        errors: list[str] = []
        self.looked = None
        for name in self.writer.remove_stale_temp_files():
            log.info("cdi.stale_temp_removed", file=name)
        try:
            owned = set(self.writer.owned_files())
        except CdiError as exc:
            return ReconcileReport(at=utc_now(), errors=(str(exc),))
        driver: DriverView | None = None
        desired = Desired(files={}, names={}, skipped=(), errors=())
        wanted: set[str] = set()
        if len(inventory) or claims:
            try:
                driver = self.discover(inventory)
                self.looked = (inventory, driver)
            except CdiError as exc:
                # without the driver the right content is unknown: only delete what is surely wrong
                errors.append(str(exc))
                wanted = {n for n in owned if claim_uid_of(self.claim_kind, n) in claims}
                wanted |= {spec_file_name(self.device_plugin_kind)} & owned
        if driver is not None:
            desired = desired_state(
                device_plugin_kind=self.device_plugin_kind,
                claim_kind=self.claim_kind,
                inventory=inventory,
                claims=claims,
                driver=driver,
            )
            wanted = set(desired.files)
            errors += desired.errors
        for name, spec in sorted(desired.files.items()):
            try:
                repair = self._sync(name, spec)
            except CdiError as exc:
                errors.append(str(exc))
                continue
            if repair is not None:
                repairs.append(repair)
        if keep_claim_files:
            wanted |= {n for n in owned if claim_uid_of(self.claim_kind, n)}
        for name in sorted(owned - wanted):
            try:
                if self.writer.remove(name):
                    reason = "no prepared claim" if claim_uid_of(self.claim_kind, name) else "no devices to describe"
                    repairs.append(Repair("deleted", name, reason))
            except CdiError as exc:
                errors.append(str(exc))
        for repair in repairs:
            log.info("cdi.repaired", action=repair.action, file=repair.file, reason=repair.reason)
        try:
            owned_after = tuple(self.writer.owned_files())
        except CdiError:
            owned_after = ()
        return ReconcileReport(
            at=utc_now(),
            repairs=tuple(repairs),
            errors=tuple(errors),
            skipped=desired.skipped,
            driver_version=driver.version if driver is not None else None,
            owned=owned_after,
            names=desired.names,
        )

    def _sync(self, name: str, spec: cdi_spec.Spec) -> Repair | None:
        current = self.writer.read(name)
        if current is None:
            self.writer.write(name, spec)
            return Repair("created", name, "missing")
        if current == self.writer.render(name, spec):
            return None
        reason = describe_drift(current, spec)
        self.writer.write(name, spec)
        return Repair("rewritten", name, reason)


def describe_drift(current: bytes, desired: cdi_spec.Spec) -> str:
    try:
        found = cdi_spec.loads(current.decode("utf-8"))
    except (InvalidSpecError, UnicodeDecodeError):
        return "corrupt"
    if cdi_spec.validate(found):
        return "invalid"
    mounts = {m.host_path for e in (found.container_edits,) for m in e.mounts}
    wanted = {m.host_path for m in desired.container_edits.mounts}
    if mounts != wanted:
        return "driver files changed"
    if found.device_names != desired.device_names:
        return "devices changed"
    return "content differs"
