"""The single per-device health record that both mechanisms and the debug endpoint read.

Backends emit raw :class:`Signal` s; the monitor applies the policy, keeps the record and a
short history per device, and publishes a :class:`HealthChange` for every transition.

MIG devices have records of their own: a fault NVML attributes to one MIG device (an Xid
with its GPU and compute instance ids) takes out that MIG device only, not its siblings. A
MIG device's state is the worse of its own and its parent GPU's; a GPU's state is the worse
of its own and its MIG devices' (a whole GPU with one broken instance is not handed out
whole). A passing periodic check of the GPU counts for its MIG devices too, and an operator
heal of the GPU heals them as well.

``UNMONITORED`` (the backend cannot receive health events for a device) makes a healthy
device UNKNOWN, which is out of service: an Xid on it would go unseen. ``MONITORED`` brings
it back; a device that recovers from a fault while unmonitored returns to UNKNOWN.

Everything here runs on the event loop thread; backends with threads hop to the loop
before calling :meth:`observe`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import structlog

from agent.base.feeds import Broadcast
from agent.core.config.schema import HealthConfig
from agent.core.health.model import HealthChange, HealthState, Signal, SignalKind
from agent.core.health.policy import classify, recovered
from agent.core.inventory.model import Inventory

log = structlog.get_logger("agent.health")


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    at: str  # ISO 8601 UTC
    state: HealthState
    cause: str
    xid: int | None


@dataclass(slots=True)
class DeviceHealth:
    uuid: str
    state: HealthState = HealthState.HEALTHY
    cause: str = ""
    reset_required: bool = False
    # health events cannot be received for the device (UNMONITORED without MONITORED since)
    unmonitored: bool = False
    # monotonic time of the first passed check after the last fault (None: none yet)
    clean_since: float | None = None
    # the newest fault's cause while unhealthy: the same fault again with no passing check
    # between (a lost GPU fails every check) is logged at debug and kept out of the history; a
    # different one, or one that interrupts a recovery, is news
    last_fault: str = ""
    history: deque[HistoryEntry] = field(default_factory=deque)
    xid_times: dict[int, deque[float]] = field(default_factory=dict)
    #: Xid events seen on the device since the agent started, by Xid (whatever the policy made of them)
    xids: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {
            "state": self.state.value,
            "cause": self.cause,
            "reset_required": self.reset_required,
            "history": [{"at": h.at, "state": h.state.value, "cause": h.cause, "xid": h.xid} for h in self.history],
        }


#: distinct Xids counted per device; further ones are counted under OTHER_XID
MAX_XID_KINDS = 32
OTHER_XID = -1

_SEVERITY = {HealthState.HEALTHY: 0, HealthState.UNKNOWN: 1, HealthState.UNHEALTHY: 2}


def _worse(a: HealthState, b: HealthState) -> HealthState:
    return a if _SEVERITY[a] >= _SEVERITY[b] else b


def _utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


class HealthMonitor:
    def __init__(
        self,
        *,
        config: HealthConfig,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], str] = _utc_now,
    ) -> None:
        self._config = config
        self._clock = clock
        self._wall = wall
        self._records: dict[str, DeviceHealth] = {}  # GPUs
        self._mig_records: dict[str, DeviceHealth] = {}  # MIG devices
        self._parents: dict[str, str] = {}  # MIG uuid -> GPU uuid
        self._children: dict[str, tuple[str, ...]] = {}  # GPU uuid -> MIG uuids
        self.changes: Broadcast[HealthChange] = Broadcast()
        self.transitions: dict[HealthState, int] = dict.fromkeys(HealthState, 0)

    # --- configuration -----------------------------------------------------------

    def set_inventory(self, inventory: Inventory) -> None:
        """Track the GPUs of ``inventory``; records of GPUs still present are kept."""
        records: dict[str, DeviceHealth] = {}
        mig_records: dict[str, DeviceHealth] = {}
        for gpu in inventory.gpus:
            records[gpu.uuid] = self._records.get(gpu.uuid) or self._new_record(gpu.uuid)
            for mig in gpu.mig_devices:
                mig_records[mig.uuid] = self._mig_records.get(mig.uuid) or self._new_record(mig.uuid)
        self._records = records
        self._mig_records = mig_records
        self._parents = {m.uuid: g.uuid for g in inventory.gpus for m in g.mig_devices}
        self._children = {g.uuid: tuple(m.uuid for m in g.mig_devices) for g in inventory.gpus}

    def update_config(self, config: HealthConfig) -> None:
        was_enabled = self._config.enabled
        self._config = config
        if was_enabled and not config.enabled:
            # "health checks off" means every device is served; none may stay stuck unhealthy
            for record in self._all_records():
                record.reset_required = False
                record.unmonitored = False
                record.xid_times.clear()
                record.clean_since = None
                self._transition(record, HealthState.HEALTHY, "health checks disabled", None)
        for record in self._all_records():
            if len(record.history) > config.history_size:
                record.history = deque(list(record.history)[-config.history_size :])

    def _new_record(self, uuid: str) -> DeviceHealth:
        return DeviceHealth(uuid=uuid)

    def _all_records(self) -> list[DeviceHealth]:
        return [*self._records.values(), *self._mig_records.values()]

    # --- reads --------------------------------------------------------------------

    def state(self, uuid: str) -> HealthState:
        """Effective health of a GPU or MIG device; UNKNOWN for devices the monitor does not track."""
        mig = self._mig_records.get(uuid)
        if mig is not None:
            parent = self._records.get(self._parents[uuid])
            return _worse(mig.state, parent.state) if parent is not None else mig.state
        record = self._records.get(uuid)
        if record is None:
            return HealthState.UNKNOWN
        state = record.state
        for child in self._children.get(uuid, ()):
            state = _worse(state, self._mig_records[child].state)
        return state

    def is_healthy(self, uuid: str) -> bool:
        return self.state(uuid) is HealthState.HEALTHY

    def record(self, uuid: str) -> DeviceHealth | None:
        """The device's own record (a MIG device's, not its parent's)."""
        return self._mig_records.get(uuid) or self._records.get(uuid)

    def xid_counts(self, gpu_uuid: str) -> dict[int, int]:
        """Xid events seen on a GPU and its MIG devices since start, by Xid (OTHER_XID: the rest)."""
        out: dict[int, int] = {}
        records = [self._records.get(gpu_uuid), *(self._mig_records[c] for c in self._children.get(gpu_uuid, ()))]
        for record in records:
            for xid, n in (record.xids if record is not None else {}).items():
                out[xid] = out.get(xid, 0) + n
        return out

    def counts(self) -> dict[HealthState, int]:
        """GPUs per effective state."""
        out = dict.fromkeys(HealthState, 0)
        for uuid in self._records:
            out[self.state(uuid)] += 1
        return out

    # --- writes -------------------------------------------------------------------

    def observe(self, signal: Signal) -> None:
        """Apply one signal. Called on the loop thread; never raises for unknown devices."""
        uuid = signal.uuid
        record = self.record(uuid)
        if record is None:
            log.debug("signal for untracked device ignored", uuid=signal.uuid, kind=signal.kind.value)
            return
        if not self._config.enabled and signal.kind not in (SignalKind.INJECTED_FAULT, SignalKind.INJECTED_HEAL):
            return
        if signal.kind is SignalKind.XID and signal.xid is not None:
            key = signal.xid if signal.xid in record.xids or len(record.xids) < MAX_XID_KINDS else OTHER_XID
            record.xids[key] = record.xids.get(key, 0) + 1
        now = self._clock()
        family = [record, *(self._mig_records[c] for c in self._children.get(uuid, ()))]
        if signal.kind is SignalKind.CHECK_OK:
            for member in family:  # the GPU's check covers its MIG devices
                self._on_check_ok(member, now)
            return
        if signal.kind is SignalKind.INJECTED_HEAL:
            for member in family:
                member.reset_required = False
                member.xid_times.clear()
                member.clean_since = now
                self._transition(member, self._settled(member), "healed by operator", None)
            return
        if signal.kind in (SignalKind.UNMONITORED, SignalKind.MONITORED):
            self._on_monitoring(record, watched=signal.kind is SignalKind.MONITORED, detail=signal.detail)
            return
        fault = classify(signal, self._config, record.xid_times, now)
        if fault is None:
            if signal.kind is SignalKind.XID:
                log.info("xid ignored by policy", uuid=uuid, xid=signal.xid, detail=signal.detail)
            return
        recovering, record.clean_since = record.clean_since is not None, None
        record.reset_required = record.reset_required or fault.reset_required
        if record.state is HealthState.UNHEALTHY:
            # already out of service: the newest fault restarts the quiet period, keep the record
            if fault.cause == record.last_fault and not recovering:
                log.debug("fault on unhealthy device", uuid=uuid, cause=fault.cause, xid=signal.xid)
                return
            record.last_fault = fault.cause
            self._append_history(record, HealthState.UNHEALTHY, fault.cause, signal.xid)
            log.warning("fault on unhealthy device", uuid=uuid, cause=fault.cause, xid=signal.xid)
            return
        self._transition(record, HealthState.UNHEALTHY, fault.cause, signal.xid)

    def _settled(self, record: DeviceHealth) -> HealthState:
        """The state of a device without a fault: HEALTHY, or UNKNOWN while it is unmonitored."""
        return HealthState.UNKNOWN if record.unmonitored else HealthState.HEALTHY

    def _on_monitoring(self, record: DeviceHealth, *, watched: bool, detail: str) -> None:
        record.unmonitored = not watched
        if record.state is HealthState.UNHEALTHY:
            return  # a fault outranks monitoring; recovery picks the right state later
        if watched:
            self._transition(record, HealthState.HEALTHY, "health events available again", None)
        else:
            cause = "health events cannot be received" + (f": {detail}" if detail else "")
            self._transition(record, HealthState.UNKNOWN, cause, None)

    def _on_check_ok(self, record: DeviceHealth, now: float) -> None:
        if record.state is not HealthState.UNHEALTHY or record.reset_required:
            return
        if record.clean_since is None:
            record.clean_since = now
        if recovered(clean_since=record.clean_since, now=now, quiet_s=self._config.recovery_quiet_s):
            quiet = self._config.recovery_quiet_s
            self._transition(record, self._settled(record), f"recovered after {quiet:g}s of passing checks", None)

    def _transition(self, record: DeviceHealth, new: HealthState, cause: str, xid: int | None) -> None:
        old = record.state
        if old is new:
            return
        record.state = new
        record.cause = cause if new is not HealthState.HEALTHY else ""
        record.last_fault = cause if new is HealthState.UNHEALTHY else ""
        self._append_history(record, new, cause, xid)
        self.transitions[new] += 1
        logger = log.warning if new is HealthState.UNHEALTHY else log.info
        logger("device health changed", uuid=record.uuid, old=old.value, new=new.value, cause=cause, xid=xid)
        self.changes.publish(HealthChange(uuid=record.uuid, old=old, new=new, cause=cause, xid=xid))

    def _append_history(self, record: DeviceHealth, state: HealthState, cause: str, xid: int | None) -> None:
        record.history.append(HistoryEntry(at=self._wall(), state=state, cause=cause, xid=xid))
        while len(record.history) > self._config.history_size:
            record.history.popleft()
