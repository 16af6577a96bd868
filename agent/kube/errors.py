"""Errors from talking to the Kubernetes API server; each message names the verb, URL and status.

Callers tell cases apart by type: :class:`KubeNotFoundError` (404), :class:`KubeConflictError`
(409, a stale resourceVersion or a name taken), :class:`KubeGoneError` (410, a watch's
resourceVersion is too old). Anything else is a :class:`KubeError` with ``status`` set when
the server answered and None when it did not (connection, timeout, oversized body).
"""

from __future__ import annotations

from agent.base.errors import AgentError, ConfigError

#: why nothing can be read or written on a node without API access
NO_API_REASON = "no Kubernetes API access (no --kubeconfig, and not running in a pod)"


class KubeError(AgentError):
    """A request to the API server failed.

    ``recoverable`` is per instance: connection errors, timeouts, 409, 429 and 5xx are worth
    retrying as they are; 401/403/404/422 need someone to fix RBAC, the token, the node name or
    the object sent.
    """

    def __init__(self, message: str, *, status: int | None = None, recoverable: bool = False) -> None:
        super().__init__(message)
        #: HTTP status, or None when no response came back
        self.status = status
        self.recoverable = recoverable


class KubeNotFoundError(KubeError):
    """404. ``object_missing`` tells a missing object (the server's Status names it) from a path
    the server does not serve at all (an API version that went away: re-discover)."""

    def __init__(self, message: str, *, object_missing: bool) -> None:
        super().__init__(message, status=404, recoverable=False)
        self.object_missing = object_missing


class KubeConflictError(KubeError):
    """409: the object changed since it was read (stale resourceVersion), or the name is taken."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=409, recoverable=True)


class KubeGoneError(KubeError):
    """410 Gone: the watch's resourceVersion is too old; the caller lists again."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=410, recoverable=True)


class KubeConfigError(KubeError, ConfigError):
    """The kubeconfig or the in-cluster service-account files cannot be used."""

    def __init__(self, message: str) -> None:
        super().__init__(message, recoverable=False)
