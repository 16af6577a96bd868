"""Whether a pod still exists on the API server: one GET of its metadata.

The orphan check (``agent/observe/orphans.py``) asks about pods that the kubelet's PodResources still
lists, or that a prepared claim is reserved for. :class:`KubePods` reads only the object's
metadata (``PartialObjectMetadata``: a few hundred bytes instead of the whole pod), bounded in
time and size; :class:`NoApiPods` is the null object for a node without API access, where
every answer is "unknown" and nothing is ever called an orphan.

RBAC: ``get`` on ``pods`` (``config/base/rbac.yaml``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol
from urllib.parse import quote

from agent.kube.client import METADATA_ACCEPT, KubeClient
from agent.kube.errors import KubeError, KubeNotFoundError

#: one lookup; the kubelet answers PodResources in milliseconds, the API server should too
LOOKUP_TIMEOUT_S = 5.0
#: pod metadata with many labels and annotations stays far below this
LOOKUP_MAX_BYTES = 256 * 1024
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


class PodState(StrEnum):
    PRESENT = "present"
    GONE = "gone"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class PodAnswer:
    state: PodState
    #: the pod's metadata.uid when present
    uid: str = ""
    #: why the answer is unknown
    reason: str = ""


class PodLookup(Protocol):
    async def lookup(self, namespace: str, name: str) -> PodAnswer:
        """Never raises: an API failure is an UNKNOWN answer with the reason."""
        ...


class KubePods:
    def __init__(self, client: KubeClient, *, timeout_s: float = LOOKUP_TIMEOUT_S) -> None:
        self._client = client
        self._timeout_s = timeout_s

    async def lookup(self, namespace: str, name: str) -> PodAnswer:
        if not _NAMESPACE.fullmatch(namespace) or not _NAME.fullmatch(name):
            # PodResources answers come from the kubelet: a name the API could not hold is not looked up
            return PodAnswer(PodState.UNKNOWN, reason=f"not a pod name: {namespace[:64]!r}/{name[:64]!r}")
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}"
        try:
            # resourceVersion=0: from the API server's cache, the cheapest read there is; a moment's
            # lag only delays a verdict that needs two checks anyway
            body = await self._client.get(
                path,
                {"resourceVersion": "0"},
                accept=METADATA_ACCEPT,
                timeout_s=self._timeout_s,
                max_bytes=LOOKUP_MAX_BYTES,
            )
        except KubeNotFoundError as exc:
            if exc.object_missing:
                return PodAnswer(PodState.GONE)
            return PodAnswer(PodState.UNKNOWN, reason=str(exc))
        except KubeError as exc:
            return PodAnswer(PodState.UNKNOWN, reason=str(exc))
        metadata = body.get("metadata")
        uid = metadata.get("uid") if isinstance(metadata, dict) else None
        return PodAnswer(PodState.PRESENT, uid=uid if isinstance(uid, str) else "")


class NoApiPods:
    """No API access: nothing can be looked up, so nothing is ever called gone."""

    def __init__(self, reason: str = "no Kubernetes API access") -> None:
        self._reason = reason

    async def lookup(self, namespace: str, name: str) -> PodAnswer:
        return PodAnswer(PodState.UNKNOWN, reason=self._reason)
