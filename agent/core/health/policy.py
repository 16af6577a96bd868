"""Pure health policy: what a signal means for a device, given the config and its past.

No I/O and no clocks here; the monitor passes ``now`` in. That keeps every rule testable
with a table of (signal, history) -> verdict.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from agent.core.config.schema import HealthConfig
from agent.core.health.model import Signal, SignalKind


@dataclass(frozen=True, slots=True)
class Fault:
    """A signal that takes the device out of service."""

    cause: str
    reset_required: bool


def classify(signal: Signal, config: HealthConfig, xid_times: dict[int, deque[float]], now: float) -> Fault | None:
    """Return the fault a signal amounts to, or None when it is ignored.

    ``xid_times`` is the device's record of recent Xid arrival times, updated in place for
    ``count N within T`` rules (only Xids with such a rule are recorded).
    """
    kind = signal.kind
    if kind is SignalKind.XID:
        return _classify_xid(signal, config, xid_times, now)
    if kind is SignalKind.ECC_DOUBLE_BIT:
        if config.ecc_double_bit == "ignore":
            return None
        return Fault(cause=_with_detail("uncorrectable ECC error", signal), reset_required=False)
    if kind is SignalKind.LOST:
        return Fault(cause=_with_detail("GPU lost", signal), reset_required=False)
    if kind is SignalKind.GARBAGE:
        return Fault(cause=_with_detail("NVML returned implausible values", signal), reset_required=False)
    if kind is SignalKind.INJECTED_FAULT:
        # an operator said so: it stays unhealthy until the operator heals it
        return Fault(cause=_with_detail("marked unhealthy", signal), reset_required=True)
    return None


def _classify_xid(signal: Signal, config: HealthConfig, xid_times: dict[int, deque[float]], now: float) -> Fault | None:
    xid = signal.xid if signal.xid is not None else -1
    rule = config.xids.get(xid, config.xid_default)
    reset = xid in config.reset_required_xids
    if rule.action == "ignore":
        return None
    if rule.action == "fatal":
        return Fault(cause=_with_detail(f"Xid {xid}", signal), reset_required=reset)
    times = xid_times.setdefault(xid, deque())
    times.append(now)
    while times and now - times[0] > rule.window_s:
        times.popleft()
    if len(times) < rule.count:
        return None
    times.clear()
    return Fault(
        cause=_with_detail(f"Xid {xid} seen {rule.count} times within {rule.window_s:g}s", signal),
        reset_required=reset,
    )


def _with_detail(cause: str, signal: Signal) -> str:
    return f"{cause}: {signal.detail}" if signal.detail else cause


def recovered(*, clean_since: float | None, now: float, quiet_s: float) -> bool:
    """Hysteresis: checks have passed without a fault for the whole quiet period."""
    return clean_since is not None and now - clean_since >= quiet_s
