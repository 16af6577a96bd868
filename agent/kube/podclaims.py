"""The ResourceClaims of the pods bound to this node: what the kubelet may yet ask DRA to prepare.

The scheduler allocates a pod's claims (PreBind writes ``status.allocation``) and then binds the
pod; the kubelet sees the bound pod and calls NodePrepareResources some time later. Between the
two, a claim allocated on one of our devices is in nobody's checkpoint. When a GPU drains away
from DRA such a claim must hold the drain like a prepared one (``agent/dra/claims/allocated.py``),
or the kubelet's Prepare comes after the GPU went to the device plugin, is refused, and the pod
waits forever (the scheduler never allocates an allocated claim again).

:meth:`NodePodClaims.list` is one LIST of this node's pods (``fieldSelector=spec.nodeName=<node>``,
from the API server's watch cache), whole objects (the claims are in the spec and the status),
reduced to the claim names of every pod that is not finished:

* ``spec.resourceClaims[].resourceClaimName`` (a claim the pod names),
* ``status.resourceClaimStatuses[].resourceClaimName`` (claims made from the pod's templates),
* ``status.extendedResourceClaimStatus.resourceClaimName`` (the claim the scheduler made for an
  extended resource such as ``nvidia.com/gpu`` served through DRA, Kubernetes 1.34+).

RBAC: ``list`` on ``pods`` (cluster-wide in RBAC; the field selector keeps it to this node).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.kube.client import KubeClient
from agent.kube.errors import KubeError

#: pods on one node; a kubelet runs 110 by default
MAX_PODS = 2000
#: claims named by one pod (the API allows 32 per pod, plus the extended-resource one)
MAX_CLAIMS = 64
LIST_TIMEOUT_S = 10.0
_FINISHED = ("Succeeded", "Failed")


@dataclass(frozen=True, slots=True)
class PodClaims:
    namespace: str
    pod: str
    uid: str
    claims: tuple[str, ...]


class NodePodClaims:
    def __init__(self, client: KubeClient, *, node_name: str) -> None:
        self._client = client
        self.node_name = node_name
        self.lists = 0

    async def list(self) -> list[PodClaims]:
        """The claims of this node's unfinished pods that have any. Raises KubeError."""
        self.lists += 1
        body = await self._client.list(
            "/api/v1/pods",
            {"fieldSelector": f"spec.nodeName={self.node_name}", "resourceVersion": "0"},
            timeout_s=LIST_TIMEOUT_S,
        )
        items = body.get("items") or []  # an empty list may come as null
        if not isinstance(items, list):
            raise KubeError(f"listing the pods of node {self.node_name}: the answer has no items")
        if len(items) > MAX_PODS:
            raise KubeError(f"node {self.node_name} has {len(items)} pods, more than {MAX_PODS}")
        out: list[PodClaims] = []
        for item in items:
            pod = pod_claims(item)
            if pod is not None:
                out.append(pod)
        return out


def _object(item: dict[str, Any], key: str) -> dict[str, Any]:
    value = item.get(key)
    return value if isinstance(value, dict) else {}


def pod_claims(item: Any, *, finished: bool = False) -> PodClaims | None:
    """The claims a pod object names (None: it names none, is not a pod, or has finished, unless
    ``finished``)."""
    if not isinstance(item, dict):
        return None
    metadata, spec, status = (_object(item, key) for key in ("metadata", "spec", "status"))
    if not finished and status.get("phase") in _FINISHED:
        return None
    names: list[str] = []
    for entry in spec.get("resourceClaims") or []:
        if isinstance(entry, dict):
            names.append(entry.get("resourceClaimName") or "")
    for entry in status.get("resourceClaimStatuses") or []:
        if isinstance(entry, dict):
            names.append(entry.get("resourceClaimName") or "")
    extended = status.get("extendedResourceClaimStatus")
    if isinstance(extended, dict):
        names.append(extended.get("resourceClaimName") or "")
    claims = tuple(dict.fromkeys(n for n in names if isinstance(n, str) and n))[:MAX_CLAIMS]
    namespace, name, uid = (metadata.get(k) for k in ("namespace", "name", "uid"))
    if not claims or not all(isinstance(v, str) and v for v in (namespace, name, uid)):
        return None
    return PodClaims(namespace=str(namespace), pod=str(name), uid=str(uid), claims=claims)
