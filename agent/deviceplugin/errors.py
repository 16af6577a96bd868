"""Domain errors of the device plugin; the servicer maps ``kind`` onto a gRPC status."""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import StrEnum

from agent.base.errors import AgentError


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
#: longer than any real device ID (a replica of a MIG device is about 46 characters)
MAX_ID_CHARS = 64
MAX_IDS_SHOWN = 8


def short_id(value: str, limit: int = MAX_ID_CHARS) -> str:
    """A device ID fit for a message or a log line: cut to ``limit`` characters, quoted unless plain.

    IDs come from the kubelet's side of a socket: a newline in one must never split a log line,
    and a megabyte-long one must never reach a gRPC status (its HTTP/2 encoding is quadratic).
    """
    head = value[:limit]
    shown = head if _PLAIN_ID.fullmatch(head) else repr(head)
    return shown if len(value) <= limit else f"{shown}...({len(value)} characters)"


def short_ids(ids: Sequence[str], limit: int = MAX_IDS_SHOWN) -> list[str]:
    """The first ``limit`` IDs, each cut short; :func:`format_ids` says how many more there were."""
    return [short_id(i) for i in ids[:limit]]


def format_ids(ids: Sequence[str], limit: int = MAX_IDS_SHOWN) -> str:
    """Device IDs for an error or log message: the first ``limit``, each cut short, then a count."""
    shown = ", ".join(short_ids(ids, limit))
    return shown if len(ids) <= limit else f"{shown} (+{len(ids) - limit} more)"
