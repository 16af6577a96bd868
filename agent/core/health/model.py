"""Health vocabulary shared by the backends, the monitor and every consumer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum


class HealthState(StrEnum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    UNKNOWN = "unknown"


class SignalKind(StrEnum):
    """What a backend observed about one device. Policy decides what it means."""

    XID = "xid"  # an Xid critical error event (xid set)
    ECC_DOUBLE_BIT = "ecc-double-bit"  # uncorrectable memory error
    ECC_SINGLE_BIT = "ecc-single-bit"  # corrected memory error
    LOST = "lost"  # the GPU stopped answering (NVML_ERROR_GPU_IS_LOST)
    GARBAGE = "garbage"  # NVML answered, but with values that cannot be right
    CHECK_OK = "check-ok"  # a periodic check passed
    INJECTED_FAULT = "injected-fault"  # simulated backend: an operator marked it unhealthy
    INJECTED_HEAL = "injected-heal"  # simulated backend: an operator healed it (like a reset)
    UNMONITORED = "unmonitored"  # health events cannot be received for it (NVML event wait broken)
    MONITORED = "monitored"  # health events reach the agent again after UNMONITORED


@dataclass(frozen=True, slots=True)
class Signal:
    uuid: str
    kind: SignalKind
    xid: int | None = None
    detail: str = ""
    at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, slots=True)
class HealthChange:
    """Published by the monitor whenever a device's effective health changes."""

    uuid: str
    old: HealthState
    new: HealthState
    cause: str
    xid: int | None = None
