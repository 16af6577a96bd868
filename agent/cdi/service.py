"""The CDI facade the device plugin and DRA call; the only writer of spec files.

Contract for callers:

* ``device_name`` answers from the inventory (no I/O) the qualified names of the device
  plugin spec; ``ensure_device_plugin_spec`` makes sure the file exists before the first
  Allocate answer hands such a name out. In steady state it answers from
  memory (see "Knowing the spec is current" below), so an Allocate touches no disk.
* ``prepare_claims`` writes the claims' transient specs before returning their names;
  ``unprepare_claims`` removes them. Both are idempotent and serialised with the reconciler
  by one lock; file I/O runs in worker threads.
* ``run`` reconciles at start and then every ``reconcile_interval_s`` (at once when the
  inventory changes or one of its files does), repairing deleted, drifted and orphaned files.
  It never ends by itself; errors are logged, counted and shown on ``debug_state``, never raised.

Knowing the spec is current: the service remembers the inventory and the *change count* under
which the device plugin spec was last written or read back equal to what it should be. The
change count moves whenever the directory watch (running inside ``run``) reports the spec file
or loses track (``RESCAN``); the inventory is compared by identity (a new inventory is a new
object). While both still match, the file is what it was and ``ensure_device_plugin_spec``
returns at once, without the lock; otherwise it checks (and repairs) the file under the lock in
a worker thread. Without a running watch nothing is trusted and every call checks the disk.
A change made in the instant before the watch reports it can be answered from memory once;
the reconciler repairs it a few milliseconds later either way. The driver's own files changing
(an upgrade) is the reconciler's and the inventory refresh's to notice, as before.

Where the device edits come from (the installed driver, or env-only edits for simulated
GPUs on a node without a driver) is decided once, at construction, by
:func:`agent.cdi.driversource.choose_driver_source`; names and files are the same either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from agent.base.feeds import Subscription
from agent.base.fswatch import RESCAN, DirectoryWatcher
from agent.cdi import generate
from agent.cdi.claimenv import ClaimDevices, as_claim_devices, with_env
from agent.cdi.discovery import DriverDiscovery
from agent.cdi.driversource import choose_driver_source
from agent.cdi.errors import CdiError, DriverDiscoveryError, UnknownCdiDeviceError
from agent.cdi.generate import DriverView
from agent.cdi.hooks import HOOK_CANDIDATES
from agent.cdi.names import check_claim_uid, device_part, qualified_name, spec_file_name, transient_spec_file_name
from agent.cdi.reconciler import ACTIONS, Reconciler, ReconcileReport
from agent.cdi.writer import SpecWriter
from agent.core.config.schema import CdiConfig, Config
from agent.core.inventory.current import InventoryState
from agent.core.inventory.model import Inventory

log = structlog.get_logger("agent.cdi")

#: answers "which claims are prepared, with which devices" (the DRA checkpoint); a value is
#: the claim's device UUIDs, or a ClaimDevices when the claim adds environment variables
#: answers "which claims are prepared, with which devices" (the DRA checkpoint), or None when it
#: cannot tell yet (checkpoint unreadable): then every claim spec on disk is kept as it is
PreparedClaims = Callable[[], Mapping[str, Sequence[str] | ClaimDevices] | None]


class CdiProvider(Protocol):
    """What the device plugin and DRA code against (CdiService or NullCdiService)."""

    def device_name(self, device_uuid: str) -> str: ...

    async def ensure_device_plugin_spec(self) -> None: ...

    async def prepare_claims(self, claims: Mapping[str, ClaimDevices]) -> dict[str, list[str] | CdiError]: ...

    async def unprepare_claims(self, claim_uids: Sequence[str]) -> dict[str, CdiError | None]: ...

    def set_prepared_claims(self, source: PreparedClaims) -> None: ...

    async def run(self) -> None: ...

    def last_pass_ok(self) -> tuple[bool, str]: ...

    def debug_state(self) -> dict[str, object]: ...


class CdiService:
    """The real CDI service. Building it on a simulated node looks at the driver root once
    (a few directory listings) to choose the driver source.

    ``driver_root`` is where the agent sees the driver; ``host_driver_root`` (None: the same)
    where the host's container runtime sees it, which is what the specs name. The hook
    binary is ``config.hook_path`` (a host path) when set, else the first of ``hook_candidates``.
    """

    def __init__(
        self,
        *,
        config: CdiConfig,
        cdi_root: Path,
        driver_root: Path,
        inventory: InventoryState,
        registry: CollectorRegistry | None = None,
        host_driver_root: Path | None = None,
        hook_candidates: Iterable[Path] = HOOK_CANDIDATES,
        sysfs_root: Path = Path("/sys"),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        #: the inventory this service follows (the agent's; tests update it directly)
        self.inventories = inventory
        self._cdi_root = cdi_root
        self._driver_root = driver_root
        self._writer = SpecWriter(
            cdi_root, (config.device_plugin_kind, config.claim_kind), transient_kinds=(config.claim_kind,)
        )
        discovery = DriverDiscovery(
            driver_root,
            host_driver_root=host_driver_root,
            hook_path=config.hook_path,
            hook_candidates=hook_candidates,
            sysfs_root=sysfs_root,
        )
        self._host_driver_root = discovery.roots.host_root
        self._driver = choose_driver_source(inventory.current.backend, discovery)
        self._reconciler = Reconciler(
            writer=self._writer,
            source=self._driver,
            device_plugin_kind=config.device_plugin_kind,
            claim_kind=config.claim_kind,
        )
        self._lock = asyncio.Lock()
        self._kick = asyncio.Event()
        #: moves when the spec file may have changed behind our back (see the module docstring)
        self._changes = 0
        #: whether a directory watch is reporting changes now (else no memory is trusted)
        self._watching = False
        #: (change count, inventory) under which the device plugin spec was last known current
        self._known_current: tuple[int, Inventory] | None = None
        #: ensure_device_plugin_spec calls that had to look at the disk (debug state)
        self._spec_checks = 0
        self._claims: dict[str, ClaimDevices] = {}  # prepared through this service
        self._unprepared: set[str] = set()  # until the external source forgets them too
        self._source: PreparedClaims | None = None
        self._skipped: frozenset[str] = frozenset()
        self._last: ReconcileReport | None = None
        self._passes = 0
        #: directory-watch reports that started a pass, and owned names reported that were the
        #: agent's own write, left as it was (no pass needed)
        self._watch_kicks = 0
        self._watch_echoes = 0
        #: the driver as the last pass or claim write looked at it: (inventory, view, when)
        self._driver_view: tuple[Inventory, DriverView, float] | None = None
        #: looks at the driver that claim writes made themselves (debug state)
        self._driver_looks = 0
        self._clock = clock
        self._last_error: str | None = None
        self._repair_totals: dict[str, int] = dict.fromkeys(ACTIONS, 0)
        registry = registry if registry is not None else CollectorRegistry()
        self._repairs = Counter(
            "gpu_agent_cdi_repairs", "CDI spec files the reconciler repaired", ["action"], registry=registry
        )
        for action in ACTIONS:
            self._repairs.labels(action=action)
        self._errors = Counter(
            "gpu_agent_cdi_reconcile_errors", "CDI reconcile passes that hit an error", registry=registry
        )
        self._owned_gauge = Gauge("gpu_agent_cdi_spec_files", "CDI spec files the agent owns", registry=registry)
        self._pass_seconds = Histogram(
            "gpu_agent_cdi_reconcile_duration_seconds",
            "Time one CDI reconcile pass took (driver discovery, reading, comparing and writing the specs)",
            registry=registry,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        )

    def _inventory(self) -> Inventory:
        return self.inventories.current

    # -- names --------------------------------------------------------------------------------

    def device_name(self, device_uuid: str) -> str:
        """``vendor/class=name`` of a GPU or MIG device in the device plugin spec."""
        inv = self._inventory()
        if inv.find_mig(device_uuid) is None and not any(g.uuid == device_uuid for g in inv):
            raise UnknownCdiDeviceError(f"device {device_uuid!r} is not on this node")
        return self._checked_name(device_uuid)

    def _checked_name(self, uuid: str) -> str:
        if uuid in self._skipped:
            raise UnknownCdiDeviceError(f"device {uuid!r} is left out of the CDI spec: its device nodes are missing")
        return qualified_name(self._config.device_plugin_kind, device_part(uuid))

    # -- device plugin spec -------------------------------------------------------------------

    async def ensure_device_plugin_spec(self) -> None:
        """Make sure the device plugin spec is on disk and current; raises on failure. Idempotent.

        Called by every Allocate that hands out CDI names: answers from memory while the spec is
        known current, and only then takes no lock and does no I/O.
        """
        if self._spec_known_current():
            return
        async with self._lock:
            if self._spec_known_current():  # another caller checked it while we waited
                return
            changes, inventory = self._changes, self._inventory()
            self._spec_checks += 1
            await asyncio.to_thread(self._sync_device_plugin, inventory)
            self._known_current = (changes, inventory)

    def _spec_known_current(self) -> bool:
        known = self._known_current
        return self._watching and known is not None and known[0] == self._changes and known[1] is self._inventory()

    def _spec_may_have_changed(self) -> None:
        self._changes += 1

    def _sync_device_plugin(self, inventory: Inventory) -> None:
        name = spec_file_name(self._config.device_plugin_kind)
        if not len(inventory):
            self._writer.remove(name)
            return
        driver = self._reconciler.discover(inventory)
        plugin = generate.device_plugin_spec(self._config.device_plugin_kind, inventory, driver)
        self._skipped = frozenset(s.partition(":")[0] for s in plugin.skipped)
        if plugin.spec is None:
            self._writer.remove(name)
            raise DriverDiscoveryError(f"no GPU of this node has its device nodes: {'; '.join(plugin.skipped)}")
        if self._writer.write(name, plugin.spec):
            log.info("cdi.spec_written", file=name, devices=len(plugin.spec.devices), driver=driver.version)

    # -- claims ---------------------------------------------------------------------------------

    def set_prepared_claims(self, source: PreparedClaims) -> None:
        """Let DRA answer which claims are prepared (used by the reconciler from now on)."""
        self._source = source

    async def prepare_claims(self, claims: Mapping[str, ClaimDevices]) -> dict[str, list[str] | CdiError]:
        """Write several claims' specs in one worker-thread hop, atomically but without fsync (the
        DRA checkpoint, written beside them, is their durable record; see ``docs/cdi.md``).

        Each claim succeeds or fails alone: its value is one qualified name per device, in
        order, or the CdiError that stopped it (nothing is written for it then).
        """
        out: dict[str, list[str] | CdiError] = {}
        valid: dict[str, ClaimDevices] = {}
        for uid, claim in claims.items():
            try:
                check_claim_uid(uid)
                if not claim.devices:
                    raise CdiError(f"claim {uid}: no devices to prepare")
            except CdiError as exc:
                out[uid] = exc
                continue
            valid[uid] = claim
        if not valid:
            return out
        async with self._lock:
            written = await asyncio.to_thread(self._write_claims, valid, self._inventory())
            for uid, outcome in written.items():
                if not isinstance(outcome, CdiError):
                    self._claims[uid] = valid[uid]
                    self._unprepared.discard(uid)
        out.update(written)
        return out

    def _write_claims(
        self, claims: Mapping[str, ClaimDevices], inventory: Inventory
    ) -> dict[str, list[str] | CdiError]:
        out: dict[str, list[str] | CdiError] = {}
        try:
            driver = self._driver_for_claims(inventory)
        except CdiError as exc:
            return dict.fromkeys(claims, exc)
        try:
            others = self._writer.defined_names()  # the conflict check lists the directory once a batch
        except CdiError as exc:
            return dict.fromkeys(claims, exc)
        for uid, claim in claims.items():
            try:
                out[uid] = self._write_claim(uid, claim, inventory, driver, others)
            except CdiError as exc:
                out[uid] = exc
        return out

    def _driver_for_claims(self, inventory: Inventory) -> DriverView:
        """The driver as seen within the last reconcile interval for this very inventory, else a
        new look. A look at an installed driver lists and stats a few hundred files (11 ms here
        for a small fake driver tree); every prepare made one. A driver that changes under the
        same inventory (files replaced, a device node gone) is seen by the next pass, which
        rewrites the claim specs that differ, as it did for specs written before the change."""
        now = self._clock()
        held = self._driver_view
        if held is not None and held[0] is inventory and now - held[2] < self._config.reconcile_interval_s:
            return held[1]
        view = self._reconciler.discover(inventory)
        self._driver_looks += 1
        self._driver_view = (inventory, view, now)
        return view

    def _write_claim(
        self,
        claim_uid: str,
        claimed: ClaimDevices,
        inventory: Inventory,
        driver: DriverView,
        others: dict[str, frozenset[str]],
    ) -> list[str]:
        kind = self._config.claim_kind
        devices = claimed.devices
        claim = with_env(generate.claim_spec(kind, claim_uid, devices, inventory, driver), claimed.env, claimed.mounts)
        if claim.skipped or claim.spec is None:
            raise DriverDiscoveryError(f"claim {claim_uid}: {'; '.join(claim.skipped)}")
        self._writer.write(transient_spec_file_name(kind, claim_uid), claim.spec, durable=False, others=others)
        return [qualified_name(kind, claim.names[d]) for d in devices]

    async def unprepare_claims(self, claim_uids: Sequence[str]) -> dict[str, CdiError | None]:
        """Remove several claims' specs in one hop (no fsync, as above); per claim, the error if any."""
        out: dict[str, CdiError | None] = {}
        valid: list[str] = []
        for uid in claim_uids:
            try:
                check_claim_uid(uid)
            except CdiError as exc:
                out[uid] = exc
                continue
            valid.append(uid)
        if not valid:
            return out
        async with self._lock:
            removed = await asyncio.to_thread(self._remove_claims, valid)
            for uid, error in removed.items():
                if error is None:
                    self._claims.pop(uid, None)
                    if self._source is not None:
                        self._unprepared.add(uid)
        out.update(removed)
        return out

    def _remove_claims(self, claim_uids: Sequence[str]) -> dict[str, CdiError | None]:
        out: dict[str, CdiError | None] = {}
        for uid in claim_uids:
            try:
                self._writer.remove(transient_spec_file_name(self._config.claim_kind, uid), durable=False)
                out[uid] = None
            except CdiError as exc:
                out[uid] = exc
        return out

    def prepared_claims(self) -> dict[str, ClaimDevices] | None:
        """The external source's claims, plus ours (a claim's spec may be written before the
        source records the claim); None while the source cannot tell."""
        out: dict[str, ClaimDevices] = {}
        if self._source is not None:
            answer = self._source()
            if answer is None:
                return None
            external = {uid: as_claim_devices(devs) for uid, devs in answer.items()}
            self._unprepared &= set(external)  # forgotten by the source: the tombstone can go
            out.update({uid: devs for uid, devs in external.items() if uid not in self._unprepared})
        out.update(self._claims)
        return out

    # -- reconciling ----------------------------------------------------------------------------

    async def reconcile_once(self) -> ReconcileReport:
        with self._pass_seconds.time():
            return await self._reconcile_once()

    async def _reconcile_once(self) -> ReconcileReport:
        async with self._lock:
            claims = self.prepared_claims()
            changes, inventory = self._changes, self._inventory()
            report = await asyncio.to_thread(
                self._reconciler.reconcile,
                inventory,
                claims if claims is not None else self._claims,
                keep_claim_files=claims is None,
            )
            looked = self._reconciler.looked
            self._driver_view = None if looked is None else (*looked, self._clock())
            self._skipped = frozenset(s.partition(":")[0] for s in report.skipped)
            plugin_file = spec_file_name(self._config.device_plugin_kind)
            if not report.errors and (plugin_file in report.owned or not len(inventory)):
                self._known_current = (changes, inventory)
            else:
                self._known_current = None
        self._record(report)
        return report

    def _record(self, report: ReconcileReport) -> None:
        self._last = report
        self._passes += 1
        for repair in report.repairs:
            self._repairs.labels(action=repair.action).inc()
            self._repair_totals[repair.action] += 1
        self._owned_gauge.set(len(report.owned))
        if report.errors:
            self._errors.inc()
            self._last_error = "; ".join(report.errors)
            log.warning("cdi.reconcile_failed", errors=list(report.errors))

    async def run(self) -> None:
        """Reconcile now, then every interval and whenever one of our files changes, until cancelled.

        The interval is the guarantee; the directory watch is the fast path (a spec deleted by
        hand, or a tmpfs emptied, is back within milliseconds instead of at the next tick).
        """
        with self.inventories.changes.subscribe() as inventory_changes:
            async with DirectoryWatcher(self._cdi_root) as watcher, asyncio.TaskGroup() as tg:
                tg.create_task(self._kick_on_changes(watcher), name="cdi-watch")
                tg.create_task(self._kick_on_inventory(inventory_changes), name="cdi-watch-inventory")
                self._spec_may_have_changed()  # whatever happened before the watch is unknown
                self._watching = True
                try:
                    await self._reconcile_loop()
                finally:
                    self._watching = False

    async def _kick_on_inventory(self, changes: Subscription[Inventory]) -> None:
        """A new inventory (MIG change, driver upgrade, GPUs found): the next pass runs at once."""
        async for _ in changes:
            self._kick.set()

    async def _kick_on_changes(self, watcher: DirectoryWatcher) -> None:
        plugin_file = spec_file_name(self._config.device_plugin_kind)
        async for names in watcher:
            # RESCAN: the watcher lost track (overflow, directory replaced): any spec may be gone
            if RESCAN in names or plugin_file in names:
                self._spec_may_have_changed()
            if RESCAN in names:
                self._kick.set()
                self._watch_kicks += 1
                continue
            owned = [n for n in names if self._writer.owns(n)]
            # a file the agent just wrote or removed, still as it left it, is that write's echo:
            # a pass would find nothing to do (one ran after every prepare and unprepare)
            changed = [n for n in owned if not self._writer.left_as_is(n)]
            self._watch_echoes += len(owned) - len(changed)
            if changed:
                self._kick.set()
                self._watch_kicks += 1

    async def _reconcile_loop(self) -> None:
        interval = self._config.reconcile_interval_s
        while True:
            self._kick.clear()
            try:
                await self.reconcile_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the loop alive; the next pass may succeed
                self._errors.inc()
                self._last_error = f"reconcile crashed: {exc!r}"
                log.exception("cdi.reconcile_crashed")
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
            # arrives as the kick fires, and this loop would then never stop
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._kick.wait()

    def last_pass_ok(self) -> tuple[bool, str]:
        """Whether the last reconcile pass wrote everything it should (False before the first)."""
        if self._last is None:
            return False, "CDI specs not reconciled yet"
        if self._last.errors:
            return False, "CDI specs cannot be written: " + "; ".join(self._last.errors)
        return True, ""

    def debug_state(self) -> dict[str, object]:
        last = self._last
        return {
            "enabled": True,
            "cdi_root": str(self._cdi_root),
            "driver_root": str(self._driver_root),
            "host_driver_root": str(self._host_driver_root),
            "driver_mode": self._driver.mode,
            "driver_version": last.driver_version if last else None,
            "files": list(last.owned) if last else [],
            "claims": sorted(self.prepared_claims() or ()),
            "skipped_devices": list(last.skipped) if last else [],
            "last_reconcile": last.at if last else None,
            "reconcile_passes": self._passes,
            "watch_kicks": self._watch_kicks,
            "watch_echoes": self._watch_echoes,
            "claim_driver_looks": self._driver_looks,
            "last_repairs": [r.as_dict() for r in last.repairs] if last else [],
            "repairs_total": dict(self._repair_totals),
            "last_errors": list(last.errors) if last else [],
            "last_error": self._last_error,
            "device_plugin_spec_known_current": self._spec_known_current(),
            "device_plugin_spec_checks": self._spec_checks,
        }


class NullCdiService:
    """CDI switched off (``cdi.enabled: false``): writes nothing, knows no device names."""

    def device_name(self, device_uuid: str) -> str:
        raise UnknownCdiDeviceError("CDI is disabled (cdi.enabled: false)")

    async def ensure_device_plugin_spec(self) -> None:
        return None

    async def prepare_claims(self, claims: Mapping[str, ClaimDevices]) -> dict[str, list[str] | CdiError]:
        # a DRA claim prepared without CDI devices would start a container without its GPUs
        return {
            uid: CdiError(f"claim {uid}: CDI is disabled (cdi.enabled: false), so no device can be injected")
            for uid in claims
        }

    async def unprepare_claims(self, claim_uids: Sequence[str]) -> dict[str, CdiError | None]:
        return dict.fromkeys(claim_uids)

    def set_prepared_claims(self, source: PreparedClaims) -> None:
        return None

    async def run(self) -> None:
        await asyncio.Event().wait()

    def last_pass_ok(self) -> tuple[bool, str]:
        return True, ""

    def debug_state(self) -> dict[str, object]:
        return {"enabled": False}


def create_cdi_service(
    config: Config, *, inventory: InventoryState, registry: CollectorRegistry | None = None
) -> CdiProvider:
    """The composition root's one call: the real service for the node config, or the null one.

    Specs name driver files under ``paths.host_driver_root``, where the host's runtime sees
    what the agent sees under ``paths.driver_root``. Nothing is written here: the service's
    first reconcile pass (at start of ``run``) writes the device plugin spec.
    """
    if not config.cdi.enabled:
        return NullCdiService()
    return CdiService(
        config=config.cdi,
        cdi_root=config.paths.cdi_root,
        driver_root=config.paths.driver_root,
        inventory=inventory,
        registry=registry,
        host_driver_root=config.paths.host_driver_root,
    )
