"""Domain errors of the device plugin; the servicer maps ``kind`` onto a gRPC status."""

from __future__ import annotations

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
