"""The pods bound to this node, as the API server has them: one watch, and a GET to confirm.

The orphan check (``agent/observe/orphans.py``) asks about pods that the kubelet's PodResources
still lists, or that a prepared claim is reserved for. :class:`NodePods` answers from one watch of
this node's pods (``fieldSelector=spec.nodeName=<node>``, the selector the kubelet itself uses),
so that a pod going away is *pushed* to the agent instead of being polled for: in steady state it
costs one open stream, resumed from its resourceVersion (``agent/kube/listwatch.py``). The list is
metadata only (``PartialObjectMetadata``: names and UIDs, none of the spec), so a node with many
pods stays far inside the list bound. The stream carries metadata too, unless ``arrivals`` wants
whole pods: DRA's claim prefetch (``agent/kube/claims/prefetch.py``) reads the claims a pod names
the moment it arrives on the node, from the same stream (one event is one pod, bounded by the
client's ``watch_line_bytes``; what is kept from it is still its name and UID).

:meth:`NodePods.state` answers from the watch without I/O: present (with the UID), gone (absent
from a current, complete view) or unknown (the view is not current, or was cut at ``max_pods``).
:meth:`NodePods.lookup` is one GET of the pod's metadata, from the API server's cache: the orphan
check asks it once before calling a pod gone, and when the watch cannot answer. A GET that finds a
pod the watch does not have means the view is wrong, and the watch lists again.

:class:`NoApiPods` is the null object for a node without API access: every answer is "unknown",
so nothing is ever called an orphan.

RBAC: ``list`` and ``watch`` on ``pods`` (RBAC cannot scope them to one node: the field selector
does), ``get`` for the confirmations (``config/base/rbac.yaml``).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol
from urllib.parse import quote

import structlog

from agent.kube.client import JSON, METADATA_ACCEPT, METADATA_LIST_ACCEPT, KubeClient
from agent.kube.errors import KubeError, KubeNotFoundError
from agent.kube.listwatch import PRODUCTION, ListWatch, WatchTiming

log = structlog.get_logger("agent.kube")

#: one lookup; the kubelet answers PodResources in milliseconds, the API server should too
LOOKUP_TIMEOUT_S = 5.0
#: pod metadata with many labels and annotations stays far below this
LOOKUP_MAX_BYTES = 256 * 1024
#: pods kept from the watch; a kubelet runs 110 by default, and rarely more than a few hundred
MAX_PODS = 2000
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


class PodArrivals(Protocol):
    """Told about pods arriving on the node and leaving it (whole objects, as the watch has them)."""

    def pod_added(self, pod: Any) -> None: ...

    def pod_deleted(self, pod: Any) -> None: ...


class PodLookup(Protocol):
    def state(self, namespace: str, name: str) -> PodAnswer:
        """What the watch says now; no I/O."""
        ...

    async def lookup(self, namespace: str, name: str) -> PodAnswer:
        """One GET. Never raises: an API failure is an UNKNOWN answer with the reason."""
        ...

    async def run(self) -> None:
        """Keep :meth:`state` current until cancelled."""
        ...

    def debug_state(self) -> dict[str, object]: ...


def pod_name_problem(namespace: str, name: str) -> str:
    """Why ``namespace/name`` cannot name a pod ("" when it can): PodResources answers are the kubelet's."""
    if _NAMESPACE.fullmatch(namespace) and _NAME.fullmatch(name):
        return ""
    return f"not a pod name: {namespace[:64]!r}/{name[:64]!r}"


class NodePods:
    def __init__(
        self,
        client: KubeClient,
        *,
        node_name: str,
        max_pods: int = MAX_PODS,
        timeout_s: float = LOOKUP_TIMEOUT_S,
        timing: WatchTiming = PRODUCTION,
        arrivals: PodArrivals | None = None,
    ) -> None:
        self._client = client
        self._arrivals = arrivals
        self.node_name = node_name
        self._max_pods = max_pods
        self._timeout_s = timeout_s
        #: (namespace, name) -> UID, for pods bound to this node
        self._pods: dict[tuple[str, str], str] = {}
        #: pods left out because the view was full (the view is then incomplete)
        self._left_out = 0
        self.lookups = 0
        self._watch = ListWatch(
            client,
            path="/api/v1/pods",
            params={"fieldSelector": f"spec.nodeName={node_name}"},
            on_list=self._listed,
            on_event=self._event,
            on_error=self._failed,
            on_recovered=self._recovered,
            accept=METADATA_ACCEPT if arrivals is None else JSON,
            list_accept=METADATA_LIST_ACCEPT,
            timing=timing,
        )

    @property
    def watch(self) -> ListWatch:
        return self._watch

    def __len__(self) -> int:
        return len(self._pods)

    async def run(self) -> None:
        await self._watch.run()

    def state(self, namespace: str, name: str) -> PodAnswer:
        problem = pod_name_problem(namespace, name)
        if problem:
            return PodAnswer(PodState.UNKNOWN, reason=problem)
        uid = self._pods.get((namespace, name))
        if uid is not None:
            return PodAnswer(PodState.PRESENT, uid=uid)
        if not self._watch.fresh():
            why = self._watch.last_error or "the pod watch is not current"
            return PodAnswer(PodState.UNKNOWN, reason=why)
        if self._left_out:
            return PodAnswer(PodState.UNKNOWN, reason=f"more than {self._max_pods} pods on the node; not all are known")
        return PodAnswer(PodState.GONE)

    async def lookup(self, namespace: str, name: str) -> PodAnswer:
        problem = pod_name_problem(namespace, name)
        if problem:
            return PodAnswer(PodState.UNKNOWN, reason=problem)
        self.lookups += 1
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}"
        try:
            # resourceVersion=0: from the API server's cache, the cheapest read there is
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
        uid = _uid_of(body)
        known = self._pods.get((namespace, name))
        if known is None and self._watch.fresh() and not self._left_out:
            # the watch says it is not there: the view is wrong; start it again from a list
            log.warning("the pod watch missed a pod; listing again", namespace=namespace, pod=name)
            self._watch.relist()
        return PodAnswer(PodState.PRESENT, uid=uid)

    def debug_state(self) -> dict[str, object]:
        watch = self._watch.debug_state()
        return {"pods": len(self._pods), "left_out": self._left_out, "lookups": self.lookups, **watch}

    # --- the watch's callbacks ---------------------------------------------------------------

    def _listed(self, items: list[Any]) -> None:
        pods: dict[tuple[str, str], str] = {}
        left_out = 0
        for item in items:
            key = _key_of(item)
            if key is None:
                continue
            if len(pods) >= self._max_pods:
                left_out += 1
                continue
            pods[key] = _uid_of(item)
        self._pods = pods
        self._set_left_out(left_out)

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        key = _key_of(obj)
        if key is None:
            return
        if kind == "DELETED":
            self._pods.pop(key, None)
        elif key in self._pods or len(self._pods) < self._max_pods:
            self._pods[key] = _uid_of(obj)
        else:
            self._set_left_out(self._left_out + 1)
        if self._arrivals is None:
            return
        try:
            if kind == "ADDED":
                self._arrivals.pod_added(obj)
            elif kind == "DELETED":
                self._arrivals.pod_deleted(obj)
        except Exception:  # a read ahead is an optimisation: it never costs the watch
            log.exception("pod arrival not handled", namespace=key[0], pod=key[1])

    def _set_left_out(self, count: int) -> None:
        if count and not self._left_out:
            log.warning(
                "more pods on the node than the agent keeps; pods it does not keep are never called gone",
                node=self.node_name,
                max_pods=self._max_pods,
            )
        self._left_out = count

    def _failed(self, exc: KubeError) -> None:
        if self._watch.last_error:
            log.debug("pod watch still failing", node=self.node_name, error=str(exc))
            return
        hint = " (the service account needs list/watch on pods)" if exc.status == 403 else ""
        log.warning("cannot watch the node's pods; retrying with backoff" + hint, node=self.node_name, error=str(exc))

    def _recovered(self) -> None:
        log.info("the node's pods are watched again", node=self.node_name)


def _key_of(obj: Any) -> tuple[str, str] | None:
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(metadata, dict):
        return None
    namespace, name = metadata.get("namespace"), metadata.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str) or pod_name_problem(namespace, name):
        return None
    return namespace, name


def _uid_of(obj: Any) -> str:
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    uid = metadata.get("uid") if isinstance(metadata, dict) else None
    return uid[:64] if isinstance(uid, str) else ""


class NoApiPods:
    """No API access: nothing can be looked up, so nothing is ever called gone."""

    def __init__(self, reason: str = "no Kubernetes API access") -> None:
        self._reason = reason

    def state(self, namespace: str, name: str) -> PodAnswer:
        return PodAnswer(PodState.UNKNOWN, reason=self._reason)

    async def lookup(self, namespace: str, name: str) -> PodAnswer:
        return PodAnswer(PodState.UNKNOWN, reason=self._reason)

    async def run(self) -> None:
        """Nothing to follow; waits until cancelled (a root task must not return)."""
        await asyncio.Event().wait()

    def debug_state(self) -> dict[str, object]:
        return {"pods": None, "last_error": self._reason}
