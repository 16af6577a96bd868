"""What the kubelet's plugin watcher has told this plugin, and what the plugin tells it.

The kubelet calls ``GetInfo`` on the registration socket (1 s deadline), validates the
answer, then reports the outcome with ``NotifyRegistrationStatus``. It does this again after
every restart of the kubelet (it walks ``plugins_registry/``) and whenever the registration
socket is re-created, so registered -> (restart) -> registered is the normal life of a plugin.

A rejection is not an error of ours to return: the kubelet's reason is logged, counted and
kept for ``/readyz`` and ``/debug/state``, and the call answers OK (returning an error on a
*successful* registration would make the kubelet undo it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import structlog

log = structlog.get_logger("agent.dra")

PLUGIN_TYPE = "DRAPlugin"
#: gRPC services on the DRA socket, in order of preference (1.34+ kubelets take the first they know)
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
#: the kubelet's reason is quoted at most this long
MAX_REASON = 512


def _utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class PluginInfo:
    type: str
    name: str
    endpoint: str
    supported_versions: tuple[str, ...]


@dataclass(slots=True)
class RegistrationState:
    driver_name: str
    endpoint: Path
    now: Callable[[], str] = _utc_now
    #: "waiting" (no answer from a kubelet yet), "registered" or "rejected"
    status: str = "waiting"
    reason: str = ""
    info_calls: int = 0
    last_info_at: str = ""
    notifications: int = 0
    last_notified_at: str = ""
    history: list[dict[str, str]] = field(default_factory=list)

    def info(self) -> PluginInfo:
        """What GetInfo answers; records that a kubelet asked."""
        self.info_calls += 1
        self.last_info_at = self.now()
        return PluginInfo(
            type=PLUGIN_TYPE,
            name=self.driver_name,
            endpoint=str(self.endpoint),
            supported_versions=SUPPORTED_VERSIONS,
        )

    def notified(self, registered: bool, error: str) -> None:
        """Record NotifyRegistrationStatus; never raises."""
        self.notifications += 1
        self.last_notified_at = self.now()
        reason = error[:MAX_REASON]
        if registered:
            if self.status != "registered":
                log.info("dra.registered", driver=self.driver_name, endpoint=str(self.endpoint))
            self.status, self.reason = "registered", ""
        else:
            log.error("dra.registration_rejected", driver=self.driver_name, reason=reason)
            self.status, self.reason = "rejected", reason or "the kubelet gave no reason"
        self.history.append({"at": self.last_notified_at, "status": self.status, "reason": self.reason})
        del self.history[:-10]

    @property
    def registered(self) -> bool:
        return self.status == "registered"

    def as_dict(self) -> dict[str, object]:
        return {
            "status": self.status,
            "reason": self.reason,
            "get_info_calls": self.info_calls,
            "last_get_info": self.last_info_at,
            "notifications": self.notifications,
            "last_notification": self.last_notified_at,
            "history": list(self.history),
        }
