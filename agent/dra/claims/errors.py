"""Why a claim could not be prepared: one reason per failure, for the kubelet and for metrics.

A :class:`ClaimError` fails one claim of a batch; the kubelet gets its message in that
claim's ``error`` field (never as a gRPC error of the whole call) and retries the pod later.
Messages quote untrusted values (names from the API server) cut short.
"""

from __future__ import annotations

from enum import StrEnum

from agent.base.errors import AgentError

#: how much of an untrusted value an error message quotes
QUOTE_MAX = 80


class Reason(StrEnum):
    """The ``reason`` label of ``gpu_agent_dra_prepare_errors_total``."""

    BAD_REQUEST = "bad-request"  # the kubelet's claim reference itself is unusable
    CLAIM_NOT_FOUND = "claim-not-found"
    UID_MISMATCH = "uid-mismatch"
    NOT_ALLOCATED = "not-allocated"
    NOT_HERE = "not-allocated-here"  # no device of this driver, or a device of another pool
    DEVICE_UNKNOWN = "device-unknown"
    NOT_DRA_OWNED = "not-dra-owned"
    UNHEALTHY = "unhealthy"
    IN_USE = "in-use"
    BAD_CONFIG = "bad-config"
    API_ERROR = "api-error"
    TIMEOUT = "timeout"
    CDI_ERROR = "cdi-error"
    CHECKPOINT_ERROR = "checkpoint-error"
    MIG_ERROR = "mig-error"  # making or destroying a MIG instance failed
    MPS_ERROR = "mps-error"  # the GPU's MPS control daemon could not be started or configured
    INTERNAL = "internal"


class ClaimError(AgentError):
    """One claim failed; the message is what the kubelet shows on the pod."""

    def __init__(self, reason: Reason, message: str, *, recoverable: bool = True) -> None:
        super().__init__(message)
        self.reason = reason
        self.recoverable = recoverable


def quote(value: object, limit: int = QUOTE_MAX) -> str:
    """``repr`` of an untrusted value, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
