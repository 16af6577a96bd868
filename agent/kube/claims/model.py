"""A ResourceClaim as claim preparation needs it, whatever ``resource.k8s.io`` version served it.

The API client (``agent/kube``) reads a claim from the API server and turns the v1, v1beta2
or v1beta1 JSON into :class:`ResourceClaim`; preparation (``agent/dra``) reads only this
model. Everything here is plain data; nothing is validated beyond its shape, because what is
acceptable (our driver, our pool, DRA-owned devices) is preparation's decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """What the kubelet sends for a claim: ``{namespace, uid, name}``."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


@dataclass(frozen=True, slots=True)
class DeviceResult:
    """One entry of ``status.allocation.devices.results``."""

    #: ``<request>`` or ``<request>/<subrequest>`` (prioritized list)
    request: str
    driver: str
    pool: str
    device: str
    share_id: str | None = None
    admin_access: bool = False
    #: ``consumedCapacity``: capacity name -> quantity (only for devices that allow several allocations)
    consumed: Mapping[str, str] = field(default_factory=dict)

    @property
    def main_request(self) -> str:
        """The top-level request name: what the kubelet matches containers' claims against."""
        return self.request.partition("/")[0]


@dataclass(frozen=True, slots=True)
class OpaqueConfig:
    """One entry of ``status.allocation.devices.config`` with an opaque parameter block."""

    #: "FromClass" or "FromClaim"
    source: str
    driver: str
    #: the requests it applies to (empty: all); ``<request>`` or ``<request>/<subrequest>``
    requests: tuple[str, ...]
    parameters: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PodRef:
    """One ``status.reservedFor`` entry."""

    name: str
    uid: str
    resource: str = "pods"


@dataclass(frozen=True, slots=True)
class ResourceClaim:
    """The parts of a ResourceClaim that preparation reads."""

    namespace: str
    name: str
    uid: str
    #: ``status.allocation`` is set
    allocated: bool
    results: tuple[DeviceResult, ...] = ()
    configs: tuple[OpaqueConfig, ...] = ()
    reserved_for: tuple[PodRef, ...] = ()
    #: ``status.allocation.allocationTimestamp`` when the cluster sets it (RFC 3339)
    allocation_timestamp: str | None = None
    #: the API version it was read with, e.g. "resource.k8s.io/v1"
    api_version: str = ""


class ClaimSource(Protocol):
    """Reads claims from the API server (the real client, or a fake in tests)."""

    async def get_claim(self, ref: ClaimRef) -> ResourceClaim | None:
        """The claim named by ``ref`` (its UID may differ: re-created); None when it does not exist.

        Raises :class:`agent.kube.errors.KubeError` when the API server cannot answer.
        """
        ...
