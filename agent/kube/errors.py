"""Errors from talking to the Kubernetes API server; each message names the URL and status."""

from __future__ import annotations

from agent.errors import AgentError, ConfigError


class KubeError(AgentError):
    """A request to the API server failed.

    ``recoverable`` is per instance: connection errors, timeouts, 429 and 5xx are worth
    retrying as they are; 401/403/404 need someone to fix RBAC, the token or the node name.
    """

    def __init__(self, message: str, *, status: int | None = None, recoverable: bool = False) -> None:
        super().__init__(message)
        #: HTTP status, or None when no response came back
        self.status = status
        self.recoverable = recoverable


class KubeGoneError(KubeError):
    """410 Gone: the watch's resourceVersion is too old; the caller lists again."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=410, recoverable=True)


class KubeConfigError(KubeError, ConfigError):
    """The kubeconfig or the in-cluster service-account files cannot be used."""

    def __init__(self, message: str) -> None:
        super().__init__(message, recoverable=False)
