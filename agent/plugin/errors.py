"""Domain errors of the device plugin; the servicer maps ``kind`` onto a gRPC status."""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import StrEnum

from agent.errors import AgentError


class ErrorKind(StrEnum):
    #: the request itself is malformed (empty, duplicates, unknown IDs, bad sizes)
    INVALID_ARGUMENT = "invalid-argument"
    #: the request is well-formed but the node's state refuses it (unhealthy, not owned)
    FAILED_PRECONDITION = "failed-precondition"


class AllocationError(AgentError):
    def __init__(self, kind: ErrorKind, message: str, device_ids: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.kind = kind
        self.device_ids = device_ids


_PLAIN_ID = re.compile(r"[A-Za-z0-9_.:/=-]+")


def format_ids(ids: Sequence[str], limit: int = 8) -> str:
    """Device IDs for an error or log message: the first ``limit``, then a count.

    IDs come from the kubelet's side of a socket, so anything but a plain ID is shown quoted
    (a newline in an ID must never split a log line).
    """
    shown = ", ".join(i if _PLAIN_ID.fullmatch(i) else repr(i) for i in ids[:limit])
    return shown if len(ids) <= limit else f"{shown} (+{len(ids) - limit} more)"
