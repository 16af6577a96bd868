"""A fake Kubernetes API server (aiohttp, in-process, real HTTP on 127.0.0.1) that the agent's real
client talks to.

It serves what the agent uses: discovery of ``resource.k8s.io`` (v1, v1beta2, v1beta1 in any
combination), ResourceSlices (create with generateName and dryRun, get, list, watch, update,
delete with preconditions; field selectors ``spec.nodeName``/``spec.driver``, label selectors),
ResourceClaims (get; list and watch with only the metadata field selectors a real one has),
Nodes (get, list, watch, a merge patch of ``status``; capacity and allocatable when a test, as
the kubelet, or the agent sets them), Pods (get, list and watch with the field selectors a real
one allows, ``spec.nodeName`` among them; whole or as ``PartialObjectMetadata``) and Events
(create, patch, list). ResourceSlices are stored in the v1 shape and converted to and from
v1beta1's ``basic`` nesting. Validation and error wording follow what a real v1.36
kube-apiserver answers (kubernetes/kubernetes ``pkg/apis/resource/validation``, and its answers
as observed), resourceVersions are a global counter, a stale update is 409 Conflict, and a watch
from a compacted resourceVersion gets 410 Gone.

Rudeness knobs: ``delay_s`` on every response, :meth:`fail` (any status, N times or until
cleared), :meth:`hang` (accept and never answer), :meth:`close_watches` (abort),
:meth:`end_watches`, :meth:`expire_watches` (410), :meth:`compact`, :meth:`restart` (every
stream cut and every resourceVersion before it out of the window, as after a real restart),
:meth:`delete_slices` (what the kubelet does), :meth:`oversize` (an endless body), and
``taints = False`` (the DRADeviceTaints gate off: taints silently dropped). Watches that ask for
bookmarks get one every ``bookmark_s`` seconds when it is set (a real one: about every minute).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import random
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web

GROUP = "resource.k8s.io"
NODE = "gpu-node-7"
TIMEOUT = 5.0

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_QUANTITY = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]+))?")
_SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?"
)
_LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and "
    "end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
_SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
_C_ID_MSG = (
    "a valid C identifier must start with alphabetic character or '_', followed by a string of alphanumeric "
    "characters or '_' (e.g. 'my_name',  or 'MY_NAME',  or 'MyName', regex used for validation is "
    "'[A-Za-z_][A-Za-z0-9_]*')"
)
_NODE_FIELDS = "nodeName, nodeSelector, allNodes, perDeviceNodeSelection"
_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
}


def status_body(code: int, message: str, *, reason: str = "", details: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or _REASONS.get(code, ""),
        "code": code,
    }
    if details:
        body["details"] = details
    return body


def _status(code: int, message: str, **kwargs: Any) -> web.Response:
    return web.json_response(status_body(code, message, **kwargs), status=code)


def _page_not_found() -> web.Response:
    # what the apiserver answers for a path it does not serve: no Status object
    return web.Response(status=404, text="404 page not found\n", content_type="text/plain")


#: field selectors a v1.36 kube-apiserver accepts, per resource (``pkg/registry/*/strategy.go``
#: ``GetAttrs``/``ToSelectableFields``); resourceclaims have only the metadata ones
_META_FIELDS = ("metadata.name", "metadata.namespace")
_FIELDS = {
    "nodes": (*_META_FIELDS, "spec.unschedulable"),
    "pods": (
        *_META_FIELDS,
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    ),
    "resourceslices": (*_META_FIELDS, "spec.nodeName", "spec.driver"),
    "resourceclaims": _META_FIELDS,
}
_METADATA_ONLY = "as=PartialObjectMetadata"


class _BadRequest(Exception):
    pass


class _Invalid(Exception):
    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    authorization: str
    body: Any = None


@dataclass
class _Rule:
    """A rude behaviour for matching requests: a status, a hang or an endless body."""

    action: str
    times: int | None
    method: str | None
    path: str | None
    watch: bool | None
    status: int = 0
    message: str = ""
    size: int = 0

    def matches(self, request: web.Request) -> bool:
        is_watch = request.query.get("watch") == "true"
        return (
            (self.method is None or request.method == self.method)
            and (self.path is None or self.path in request.path)
            and (self.watch is None or self.watch is is_watch)
        )


@dataclass
class _Watch:
    resource: str
    version: str
    match: Callable[[dict[str, Any]], bool]
    query: dict[str, str]
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    request: web.Request | None = None


_END = object()
_ABORT = object()


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeApiServer:
    def __init__(
        self,
        *,
        versions: tuple[str, ...] = ("v1",),
        taints: bool = True,
        partitionable: bool = True,
        consumable: bool = True,
    ) -> None:
        #: resource.k8s.io versions served; tests change it to upgrade or downgrade the "cluster"
        self.versions = versions
        #: whether device taints are kept (gate DRADeviceTaints); False drops them silently
        self.taints = taints
        #: gates DRAPartitionableDevices (counters) and DRAConsumableCapacity (shared devices),
        #: on by default in 1.36; False drops their fields silently, as the real apiserver does
        self.partitionable = partitionable
        self.consumable = consumable
        #: 1.35+: at most 64 devices in a slice with taints
        self.taint_device_limit = 64
        self.rv = 100
        self.delay_s = 0.0
        #: when set, every watch that allows bookmarks gets one this often
        self.bookmark_s: float | None = None
        self.url = ""
        self.nodes: dict[str, dict[str, Any]] = {}
        #: every accepted ``nodes/<name>/status`` patch body, in order
        self.node_status_patches: list[dict[str, Any]] = []
        #: ResourceSlices in the v1 shape, by name
        self.slices: dict[str, dict[str, Any]] = {}
        #: ResourceClaims as the test gave them, by (namespace, name)
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: dict[tuple[str, str], dict[str, Any]] = {}
        #: Pods by (namespace, name)
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.requests: list[Request] = []
        #: (rv, resource, type, object) for watch replay
        self._history: list[tuple[int, str, str, dict[str, Any]]] = []
        self._compacted = 0
        self._rules: list[_Rule] = []
        self._watches: list[_Watch] = []
        self._watch_started: asyncio.Queue[dict[str, str]] = asyncio.Queue()
        self._hung: list[asyncio.Future[None]] = []
        self.bytes_sent_oversize = 0
        self._runner: web.AppRunner | None = None
        self.add_node(NODE, labels={"pool": "a100"})

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self, ssl_context: Any = None) -> FakeApiServer:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        self.end_watches()
        for hung in self._hung:
            if not hung.done():
                hung.set_result(None)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- state the tests set -----------------------------------------------------------

    def add_node(self, name: str, *, labels: dict[str, Any] | None = None, uid: str = "") -> dict[str, Any]:
        self.rv += 1
        node = {
            "kind": "Node",
            "apiVersion": "v1",
            "metadata": {
                "name": name,
                "uid": uid or f"uid-{name}",
                "resourceVersion": str(self.rv),
                "labels": dict(labels or {}),
            },
        }
        self.nodes[name] = node
        self._record("nodes", "ADDED", node)
        return node

    def set_labels(self, labels: dict[str, Any], *, node: str = NODE, **metadata: Any) -> None:
        """Relabel a node (always a MODIFIED event, even when nothing changed, like a status heartbeat)."""
        self.rv += 1
        obj = self.nodes[node]
        obj["metadata"].update(metadata, labels=dict(labels), resourceVersion=str(self.rv))
        self._record("nodes", "MODIFIED", obj)

    def set_allocatable(self, allocatable: dict[str, str], *, node: str = NODE) -> None:
        """The kubelet posts node status: ``status.allocatable`` (and capacity) become these."""
        self.rv += 1
        obj = self.nodes[node]
        obj["status"] = {"capacity": dict(allocatable), "allocatable": dict(allocatable)}
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self._record("nodes", "MODIFIED", obj)

    def add_pod(
        self,
        namespace: str,
        name: str,
        *,
        uid: str = "",
        node: str = NODE,
        phase: str = "Running",
        claims: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """``claims``: ResourceClaim names the pod's templates made (``status.resourceClaimStatuses``)."""
        self.rv += 1
        pod = {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": uid or f"uid-{namespace}-{name}",
                "resourceVersion": str(self.rv),
                "creationTimestamp": _now(),
            },
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": "cuda"}]},
            "status": {"phase": phase},
        }
        if claims:
            pod["spec"]["resourceClaims"] = [
                {"name": f"c{i}", "resourceClaimTemplateName": "t"} for i in range(len(claims))
            ]
            pod["status"]["resourceClaimStatuses"] = [
                {"name": f"c{i}", "resourceClaimName": claim} for i, claim in enumerate(claims)
            ]
        self.pods[(namespace, name)] = pod
        self._record("pods", "ADDED", pod)
        return pod

    def delete_pod(self, namespace: str, name: str) -> None:
        self.rv += 1
        pod = self.pods.pop((namespace, name))
        gone = copy.deepcopy(pod)
        gone["metadata"]["resourceVersion"] = str(self.rv)
        self._record("pods", "DELETED", gone)

    def put_claim(self, claim: dict[str, Any]) -> None:
        meta = claim["metadata"]
        self.claims[(meta["namespace"], meta["name"])] = claim

    def slices_of(self, node: str = NODE) -> list[dict[str, Any]]:
        return sorted((s for s in self.slices.values() if s["spec"].get("nodeName") == node), key=_name)

    def delete_slices(self, *, node: str | None = None, driver: str | None = None) -> int:
        """Delete slices behind the agent's back, as the kubelet does at its start."""
        doomed = [
            s
            for s in self.slices.values()
            if (node is None or s["spec"].get("nodeName") == node) and (driver is None or s["spec"]["driver"] == driver)
        ]
        for s in doomed:
            self._delete_slice(s)
        return len(doomed)

    def edit_slice(self, name: str, change: Callable[[dict[str, Any]], None]) -> None:
        """Someone else updates one of the slices (drift)."""
        obj = self.slices[name]
        change(obj["spec"])
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self._record("resourceslices", "MODIFIED", obj)

    # --- rudeness ----------------------------------------------------------------------

    def fail(
        self,
        status: int,
        *,
        times: int | None = 1,
        method: str | None = None,
        path: str | None = None,
        watch: bool | None = None,
        message: str = "",
    ) -> None:
        """Answer matching requests with ``status`` (``times=None``: until :meth:`clear`)."""
        text = message or f"the fake API server was told to answer {status}"
        self._rules.append(_Rule("fail", times, method, path, watch, status=status, message=text))

    def hang(
        self, *, times: int | None = 1, method: str | None = None, path: str | None = None, watch: bool | None = None
    ) -> None:
        """Accept matching requests and never answer them."""
        self._rules.append(_Rule("hang", times, method, path, watch))

    def oversize(self, size: int, *, times: int | None = 1, method: str | None = None, path: str | None = None) -> None:
        """Answer matching requests with a ``size``-byte body, streamed without Content-Length."""
        self._rules.append(_Rule("oversize", times, method, path, None, size=size))

    def clear(self) -> None:
        self._rules.clear()

    def end_watches(self) -> None:
        for watch in self._watches:
            watch.queue.put_nowait(_END)

    def close_watches(self) -> None:
        """Cut every open watch connection mid-stream."""
        for watch in self._watches:
            watch.queue.put_nowait(_ABORT)

    def expire_watches(self) -> None:
        """Send 410 Gone on every open watch (its resourceVersion is too old) and end it."""
        for watch in self._watches:
            watch.queue.put_nowait(
                {"type": "ERROR", "object": status_body(410, "too old resource version", reason="Expired")}
            )
            watch.queue.put_nowait(_END)

    def compact(self) -> None:
        """Forget history: a watch from any resourceVersion before now gets 410."""
        self._compacted = self.rv
        self._history.clear()

    def restart(self) -> None:
        """What clients see of an API server restart: every stream cut, and a new watch cache that
        starts after every resourceVersion they hold (a watch from one gets 410 Gone)."""
        self.close_watches()
        self.rv += 1
        self.compact()

    def push(self, event: dict[str, Any], *, resource: str = "nodes") -> None:
        """Send a raw event on every open watch of ``resource``."""
        for watch in self._watches:
            if watch.resource == resource:
                watch.queue.put_nowait(event)

    def bookmark(self, resource: str = "resourceslices") -> None:
        self.push({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": str(self.rv)}}}, resource=resource)

    # --- what tests read -----------------------------------------------------------------

    async def next_watch(self) -> dict[str, str]:
        """Wait for the next watch to connect; its query."""
        return await asyncio.wait_for(self._watch_started.get(), TIMEOUT)

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    @property
    def tokens(self) -> list[str]:
        return [r.authorization for r in self.requests]

    def count(self, method: str | None = None, path: str | None = None, *, watch: bool | None = None) -> int:
        return sum(
            1
            for r in self.requests
            if (method is None or r.method == method)
            and (path is None or path in r.path)
            and (watch is None or (r.query.get("watch") == "true") is watch)
        )

    def slice_writes(self) -> int:
        """Persisted writes to ResourceSlices (dry runs are not writes)."""
        return sum(
            1
            for r in self.requests
            if r.method in ("POST", "PUT", "DELETE", "PATCH")
            and "/resourceslices" in r.path
            and "dryRun" not in r.query
        )

    # --- dispatch ------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body: Any = None
        if request.can_read_body:
            try:
                body = await request.json()
            except ValueError:
                return _status(400, "the body is not JSON")
        self.requests.append(
            Request(request.method, request.path, dict(request.query), request.headers.get("Authorization", ""), body)
        )
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        rule = next((r for r in self._rules if r.matches(request)), None)
        if rule is not None:
            if rule.times is not None:
                rule.times -= 1
                if rule.times <= 0:
                    self._rules.remove(rule)
            if rule.action == "fail":
                return _status(rule.status, rule.message)
            if rule.action == "hang":
                hung: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self._hung.append(hung)
                await hung
                return web.Response(status=503)
            return await self._oversized(request, rule.size)
        parts = [p for p in request.path.split("/") if p]
        try:
            if parts[:2] == ["api", "v1"]:
                return await self._core(request, parts[2:], body)
            if parts == ["apis"]:
                return self._group_list()
            if parts[:2] == ["apis", GROUP]:
                return await self._resource_group(request, parts[2:], body)
        except _Invalid as exc:
            return _status(422, " ".join(exc.errors))
        except _BadRequest as exc:
            return _status(400, str(exc))
        return _page_not_found()

    async def _oversized(self, request: web.Request, size: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        chunk = b'{"items":[' + b" " * (1024 * 1024)
        sent = 0
        with contextlib.suppress(ConnectionError):
            while sent < size:
                await resp.write(chunk)
                sent += len(chunk)
                self.bytes_sent_oversize += len(chunk)
        return resp

    # --- core/v1: nodes, events ------------------------------------------------------

    async def _core(self, request: web.Request, parts: list[str], body: Any) -> web.StreamResponse:
        if parts[:1] == ["nodes"]:
            if len(parts) == 2 and request.method == "GET":
                node = self.nodes.get(parts[1])
                if node is None:
                    return _status(404, f'nodes "{parts[1]}" not found', details={"name": parts[1], "kind": "nodes"})
                return web.json_response(node)
            if len(parts) == 3 and parts[2] == "status" and request.method == "PATCH":
                return self._patch_node_status(request, parts[1], body)
            if len(parts) == 1 and request.method == "GET":
                match = self._selector(request, "nodes")
                if request.query.get("watch") == "true":
                    return await self._watch(request, "nodes", "v1", match)
                return self._list(request, "NodeList", "v1", [n for n in self.nodes.values() if match(n)])
        if len(parts) >= 3 and parts[0] == "namespaces" and parts[2] == "events":
            return self._events(request, parts[1], parts[3:], body)
        if len(parts) == 4 and parts[0] == "namespaces" and parts[2] == "pods" and request.method == "GET":
            return self._pod(request, parts[1], parts[3])
        if parts == ["pods"] and request.method == "GET":
            match = self._selector(request, "pods")
            if request.query.get("watch") == "true":
                return await self._watch(request, "pods", "v1", match)
            return self._list(request, "PodList", "v1", [p for p in self.pods.values() if match(p)])
        return _page_not_found()

    def _patch_node_status(self, request: web.Request, name: str, body: Any) -> web.Response:
        """A JSON merge patch of a Node's status, as ``kubectl patch --subresource=status`` sends it.

        A ``metadata.resourceVersion`` in the patch is a precondition (409 when stale); only
        ``status`` changes; values are kept as sent (strings)."""
        node = self.nodes.get(name)
        if node is None:
            return _status(404, f'nodes "{name}" not found', details={"name": name, "kind": "nodes"})
        if request.content_type != "application/merge-patch+json":
            return _status(415, f"unsupported patch type {request.content_type}")
        if not isinstance(body, dict) or not isinstance(body.get("status", {}), dict):
            return _status(400, "the patch is not a JSON object with an object status")
        want = (body.get("metadata") or {}).get("resourceVersion")
        if want and want != node["metadata"]["resourceVersion"]:
            return _status(
                409,
                f'Operation cannot be fulfilled on nodes "{name}": the object has been modified; '
                "please apply your changes to the latest version and try again",
                reason="Conflict",
            )
        self.node_status_patches.append(copy.deepcopy(body))
        status = node.setdefault("status", {})
        for key, value in body.get("status", {}).items():
            if isinstance(value, dict) and isinstance(status.get(key), dict):
                for k, v in value.items():
                    if v is None:
                        status[key].pop(k, None)
                    else:
                        status[key][k] = v
            elif value is None:
                status.pop(key, None)
            else:
                status[key] = copy.deepcopy(value)
        self.rv += 1
        node["metadata"]["resourceVersion"] = str(self.rv)
        self._record("nodes", "MODIFIED", node)
        return web.json_response(node)

    def _list(self, request: web.Request, kind: str, api_version: str, items: list[dict[str, Any]]) -> web.Response:
        since = request.query.get("resourceVersion", "")
        if since.isdigit() and int(since) > self.rv:
            return _status(504, f"Too large resource version: {since}, current: {self.rv}", reason="Timeout")
        body_items: list[dict[str, Any]] | None = items
        if _METADATA_ONLY in request.headers.get("Accept", ""):
            kind, api_version = "PartialObjectMetadataList", "meta.k8s.io/v1"
            # a real v1.36 API server sends an empty metadata list's items as null (a PodList's as [])
            body_items = [_metadata_only(i) for i in items] or None
        metadata = {"resourceVersion": str(self.rv)}
        return web.json_response({"kind": kind, "apiVersion": api_version, "metadata": metadata, "items": body_items})

    def _pod(self, request: web.Request, namespace: str, name: str) -> web.Response:
        pod = self.pods.get((namespace, name))
        if pod is None:
            return _status(404, f'pods "{name}" not found', details={"name": name, "kind": "pods"})
        if _METADATA_ONLY in request.headers.get("Accept", ""):
            return web.json_response(_metadata_only(pod))
        return web.json_response(pod)

    def _events(self, request: web.Request, namespace: str, rest: list[str], body: Any) -> web.Response:
        if request.method == "POST" and not rest:
            name = body["metadata"]["name"]
            if (namespace, name) in self.events:
                return _status(409, f'events "{name}" already exists', reason="AlreadyExists")
            self.rv += 1
            event = {**body, "metadata": {**body["metadata"], "namespace": namespace, "resourceVersion": str(self.rv)}}
            self.events[(namespace, name)] = event
            return web.json_response(event, status=201)
        if request.method == "PATCH" and len(rest) == 1:
            event = self.events.get((namespace, rest[0]))
            if event is None:
                return _status(404, f'events "{rest[0]}" not found', details={"name": rest[0], "kind": "events"})
            if request.content_type != "application/merge-patch+json":
                return _status(415, f"unsupported patch type {request.content_type}")
            event.update(body)
            return web.json_response(event)
        if request.method == "GET" and not rest:
            items = [e for (ns, _), e in self.events.items() if ns == namespace]
            return web.json_response({"kind": "EventList", "items": items})
        return _page_not_found()

    # --- resource.k8s.io -------------------------------------------------------------

    def _group_list(self) -> web.Response:
        groups = []
        if self.versions:
            groups.append(self._group())
        return web.json_response({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})

    def _group(self) -> dict[str, Any]:
        versions = [{"groupVersion": f"{GROUP}/{v}", "version": v} for v in self.versions]
        return {"kind": "APIGroup", "apiVersion": "v1", "name": GROUP, "versions": versions,
                "preferredVersion": versions[0]}  # fmt: skip

    async def _resource_group(self, request: web.Request, parts: list[str], body: Any) -> web.StreamResponse:
        if not self.versions:
            return _page_not_found()
        if not parts:
            return web.json_response(self._group())
        version, rest = parts[0], parts[1:]
        if version not in self.versions:
            return _page_not_found()
        if not rest:
            resources = [
                {"name": "resourceslices", "namespaced": False, "kind": "ResourceSlice"},
                {"name": "resourceclaims", "namespaced": True, "kind": "ResourceClaim"},
                {"name": "deviceclasses", "namespaced": False, "kind": "DeviceClass"},
            ]
            return web.json_response(
                {"kind": "APIResourceList", "groupVersion": f"{GROUP}/{version}", "resources": resources}
            )
        if rest[0] == "resourceslices":
            return await self._slices(request, version, rest[1:], body)
        if rest == ["resourceclaims"] and request.method == "GET":
            match = self._selector(request, "resourceclaims")
            if request.query.get("watch") == "true":
                return await self._watch(request, "resourceclaims", version, match)
            claims = [{**c, "apiVersion": f"{GROUP}/{version}"} for c in self.claims.values() if match(c)]
            return self._list(request, "ResourceClaimList", f"{GROUP}/{version}", claims)
        if len(rest) == 4 and rest[0] == "namespaces" and rest[2] == "resourceclaims" and request.method == "GET":
            claim = self.claims.get((rest[1], rest[3]))
            if claim is None:
                return _status(
                    404,
                    f'resourceclaims.{GROUP} "{rest[3]}" not found',
                    details={"name": rest[3], "group": GROUP, "kind": "resourceclaims"},
                )
            return web.json_response({**claim, "apiVersion": f"{GROUP}/{version}"})
        return _page_not_found()

    async def _slices(self, request: web.Request, version: str, rest: list[str], body: Any) -> web.StreamResponse:
        if not rest:
            if request.method == "GET":
                match = self._selector(request, "resourceslices")
                if request.query.get("watch") == "true":
                    return await self._watch(request, "resourceslices", version, match)
                items = [_to_version(s, version) for s in sorted(self.slices.values(), key=_name) if match(s)]
                return web.json_response(
                    {
                        "kind": "ResourceSliceList",
                        "apiVersion": f"{GROUP}/{version}",
                        "metadata": {"resourceVersion": str(self.rv)},
                        "items": items,
                    }
                )
            if request.method == "POST":
                return self._create_slice(version, body, dry_run=request.query.get("dryRun") == "All")
            return _status(405, "method not allowed")
        name = rest[0]
        stored = self.slices.get(name)
        if stored is None:
            return _status(
                404, f'resourceslices.{GROUP} "{name}" not found',
                details={"name": name, "group": GROUP, "kind": "resourceslices"},
            )  # fmt: skip
        if request.method == "GET":
            return web.json_response(_to_version(stored, version))
        if request.method == "PUT":
            return self._update_slice(version, stored, body)
        if request.method == "DELETE":
            preconditions = (body or {}).get("preconditions") or {}
            meta = stored["metadata"]
            if preconditions.get("uid") not in (None, meta["uid"]):
                return _status(
                    409,
                    f"Precondition failed: UID in precondition: {preconditions['uid']}, "
                    f"UID in object meta: {meta['uid']}",
                )
            if preconditions.get("resourceVersion") not in (None, meta["resourceVersion"]):
                return _status(
                    409,
                    f'Operation cannot be fulfilled on resourceslices.{GROUP} "{name}": the ResourceVersion in the '
                    f"precondition ({preconditions['resourceVersion']}) does not match the ResourceVersion in record "
                    f"({meta['resourceVersion']}). The object might have been modified",
                )
            self._delete_slice(stored)
            return web.json_response(
                {"kind": "Status", "apiVersion": "v1", "status": "Success", "details": {"name": name}}
            )
        return _status(405, "method not allowed")

    def _create_slice(self, version: str, body: Any, *, dry_run: bool) -> web.Response:
        obj = self._from_version(body, version)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            prefix = str(meta.get("generateName") or "")
            if not prefix:
                raise _Invalid(["metadata.name: Required value: name or generateName is required"])
            meta["name"] = prefix[:58] + "".join(random.choices("bcdfghjklmnpqrstvwxz2456789", k=5))
        name = meta["name"]
        _validate_slice(obj, taint_limit=self.taint_device_limit if self.taints else None)
        if name in self.slices:
            return _status(409, f'resourceslices.{GROUP} "{name}" already exists', reason="AlreadyExists")
        if not dry_run:
            self.rv += 1
            meta.update(uid=f"uid-{name}-{self.rv}", resourceVersion=str(self.rv), creationTimestamp=_now())
            self.slices[name] = obj
            self._record("resourceslices", "ADDED", obj)
        return web.json_response(_to_version(obj, version), status=201)

    def _update_slice(self, version: str, stored: dict[str, Any], body: Any) -> web.Response:
        name = stored["metadata"]["name"]
        obj = self._from_version(body, version)
        meta = obj.setdefault("metadata", {})
        if meta.get("name") != name:
            return _status(400, f"the name of the object ({meta.get('name')}) does not match the name on the URL")
        sent_rv = meta.get("resourceVersion")
        if sent_rv and sent_rv != stored["metadata"]["resourceVersion"]:
            return _status(
                409,
                f'Operation cannot be fulfilled on resourceslices.{GROUP} "{name}": the object has been modified; '
                "please apply your changes to the latest version and try again",
                details={"name": name, "group": GROUP, "kind": "resourceslices"},
            )
        errors = []
        old, new = stored["spec"], obj.get("spec") or {}
        for where, before, after in (
            ("spec.pool.name", (old.get("pool") or {}).get("name"), (new.get("pool") or {}).get("name")),
            ("spec.driver", old.get("driver"), new.get("driver")),
            ("spec.nodeName", old.get("nodeName"), new.get("nodeName")),
        ):
            if before != after:
                errors.append(f"{where}: Invalid value: {json.dumps(after)}: field is immutable")
        if errors:
            raise _Invalid(errors)
        _validate_slice(obj, taint_limit=self.taint_device_limit if self.taints else None)
        self.rv += 1
        meta.update(
            uid=stored["metadata"]["uid"],
            creationTimestamp=stored["metadata"]["creationTimestamp"],
            resourceVersion=str(self.rv),
        )
        self.slices[name] = obj
        self._record("resourceslices", "MODIFIED", obj)
        return web.json_response(_to_version(obj, version))

    def _delete_slice(self, stored: dict[str, Any]) -> None:
        name = stored["metadata"]["name"]
        del self.slices[name]
        self.rv += 1
        gone = copy.deepcopy(stored)
        gone["metadata"]["resourceVersion"] = str(self.rv)
        self._record("resourceslices", "DELETED", gone)

    def _from_version(self, body: Any, version: str) -> dict[str, Any]:
        """The v1 form of a sent slice: ``basic`` flattened, taints dropped when the gate is off."""
        if not isinstance(body, dict):
            raise _Invalid(["body: Invalid value: not an object"])
        obj = copy.deepcopy(body)
        obj["apiVersion"] = f"{GROUP}/v1"
        spec = obj.get("spec") or {}
        if not self.partitionable or version == "v1beta1":
            spec.pop("sharedCounters", None)
        devices = spec.get("devices") or []
        for i, device in enumerate(devices):
            if version == "v1beta1":
                basic = device.pop("basic", None) or {}
                device.update(basic)
            if not self.taints:
                device.pop("taints", None)
            if not self.partitionable or version == "v1beta1":
                device.pop("consumesCounters", None)
            if not self.consumable or version == "v1beta1":
                device.pop("allowMultipleAllocations", None)
                for capacity in (device.get("capacity") or {}).values():
                    if isinstance(capacity, dict):
                        capacity.pop("requestPolicy", None)
            for taint in device.get("taints") or []:
                taint.setdefault("timeAdded", _now())
            devices[i] = device
        return obj

    # --- selectors and watches -------------------------------------------------------

    def _selector(self, request: web.Request, resource: str) -> Callable[[dict[str, Any]], bool]:
        fields: dict[str, str] = {}
        for term in filter(None, request.query.get("fieldSelector", "").split(",")):
            key, _, value = term.partition("=")
            if key not in _FIELDS[resource]:
                raise _BadRequest(f"field label not supported: {key}")
            fields[key] = value
        labels = [t for t in request.query.get("labelSelector", "").split(",") if t]

        def field_of(obj: dict[str, Any], path: str) -> str:
            value: Any = obj
            for part in path.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            return str(value) if value is not None else ""

        def match(obj: dict[str, Any]) -> bool:
            if any(field_of(obj, k) != v for k, v in fields.items()):
                return False
            have = obj["metadata"].get("labels") or {}
            for term in labels:
                if "!=" in term:
                    k, v = term.split("!=", 1)
                    if have.get(k) == v:
                        return False
                elif "=" in term:
                    k, v = term.split("=", 1)
                    if have.get(k) != v.lstrip("="):
                        return False
                elif term.startswith("!"):
                    if term[1:] in have:
                        return False
                elif term not in have:
                    return False
            return True

        return match

    def _record(self, resource: str, kind: str, obj: dict[str, Any]) -> None:
        snapshot = copy.deepcopy(obj)
        self._history.append((self.rv, resource, kind, snapshot))
        for watch in self._watches:
            if watch.resource == resource and watch.match(snapshot):
                watch.queue.put_nowait({"type": kind, "object": snapshot})

    async def _watch(
        self, request: web.Request, resource: str, version: str, match: Callable[[dict[str, Any]], bool]
    ) -> web.StreamResponse:
        since = request.query.get("resourceVersion", "")
        watch = _Watch(resource, version, match, dict(request.query), request=request)
        if since and since != "0" and int(since) < self._compacted:
            watch.queue.put_nowait(
                {"type": "ERROR", "object": status_body(410, f"too old resource version: {since}", reason="Expired")}
            )
            watch.queue.put_nowait(_END)
        elif since and since != "0":
            for rv, res, kind, obj in self._history:
                if rv > int(since) and res == resource and match(obj):
                    watch.queue.put_nowait({"type": kind, "object": copy.deepcopy(obj)})
        else:
            current = {
                "nodes": self.nodes,
                "resourceslices": self.slices,
                "pods": self.pods,
                "resourceclaims": self.claims,
            }[resource].values()
            for obj in current:
                if match(obj):
                    watch.queue.put_nowait({"type": "ADDED", "object": copy.deepcopy(obj)})
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        self._watches.append(watch)
        self._watch_started.put_nowait(dict(request.query))
        timeout = float(request.query.get("timeoutSeconds") or 1800)
        metadata_only = _METADATA_ONLY in request.headers.get("Accept", "")
        bookmarks = (
            asyncio.create_task(self._bookmarks(watch)) if request.query.get("allowWatchBookmarks") == "true" else None
        )
        try:
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(timeout):
                    async for item in _drain(watch.queue):
                        if item is _END:
                            break
                        if item is _ABORT:
                            assert request.transport is not None
                            request.transport.abort()
                            return resp
                        if isinstance(item, dict) and isinstance(item.get("object"), dict):
                            obj = item["object"]
                            if resource == "resourceslices" and obj.get("kind") != "Status" and "spec" in obj:
                                item = {**item, "object": _to_version(obj, version)}
                            elif metadata_only and obj.get("kind") != "Status":
                                item = {**item, "object": _metadata_only(obj)}
                        await resp.write(json.dumps(item).encode() + b"\n")
                await resp.write_eof()
        finally:
            if bookmarks is not None:
                bookmarks.cancel()
            self._watches.remove(watch)
        return resp

    async def _bookmarks(self, watch: _Watch) -> None:
        while True:
            if self.bookmark_s is None:
                await asyncio.sleep(0.05)
                continue
            await asyncio.sleep(self.bookmark_s)
            watch.queue.put_nowait({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": str(self.rv)}}})


@contextlib.asynccontextmanager
async def serving(**kwargs: Any) -> AsyncIterator[FakeApiServer]:
    """A started fake server, stopped on exit."""
    api = await FakeApiServer(**kwargs).start()
    try:
        yield api
    finally:
        await api.stop()


def write_kubeconfig(tmp_path: Path, server: str, user: dict[str, Any] | None = None, **cluster: Any) -> Path:
    """A kubeconfig for ``server`` (token "t0" unless ``user`` says otherwise)."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "ctx",
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
        "clusters": [{"name": "c", "cluster": {"server": server, **cluster}}],
        "users": [{"name": "u", "user": user if user is not None else {"token": "t0"}}],
    }
    path = tmp_path / f"kubeconfig-{random.randrange(1 << 30)}"
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


async def _drain(queue: asyncio.Queue[Any]) -> AsyncIterator[Any]:
    while True:
        yield await queue.get()


def _metadata_only(obj: dict[str, Any]) -> dict[str, Any]:
    """What a real API server sends for ``Accept: ...;as=PartialObjectMetadata``."""
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": copy.deepcopy(obj["metadata"])}


def _name(obj: dict[str, Any]) -> str:
    return str(obj["metadata"]["name"])


def _to_version(obj: dict[str, Any], version: str) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["apiVersion"] = f"{GROUP}/{version}"
    out.setdefault("kind", "ResourceSlice")
    if version == "v1beta1":
        devices = out["spec"].get("devices") or []
        for i, device in enumerate(devices):
            basic = {k: device.pop(k) for k in ("attributes", "capacity", "taints") if k in device}
            devices[i] = {**device, "basic": basic}
    return out


def _validate_slice(obj: dict[str, Any], *, taint_limit: int | None) -> None:
    """The apiserver's checks of a v1 ResourceSlice, with its wording."""
    errors: list[str] = []
    name = str(obj["metadata"].get("name") or "")
    if len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
        errors.append(f'metadata.name: Invalid value: "{name}": {_SUBDOMAIN_MSG}')
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        raise _Invalid(["spec: Required value"])
    driver = spec.get("driver")
    if not driver:
        errors.append("spec.driver: Required value")
    elif len(driver) > 63:
        errors.append("spec.driver: Too long: may not be more than 63 bytes")
    elif not _DNS_SUBDOMAIN.fullmatch(str(driver).lower()) or driver != driver.lower():
        errors.append(f'spec.driver: Invalid value: "{driver}": {_SUBDOMAIN_MSG}')
    pool = spec.get("pool") or {}
    if not pool.get("name"):
        errors.append("spec.pool.name: Required value")
    if not isinstance(pool.get("resourceSliceCount"), int) or pool["resourceSliceCount"] <= 0:
        errors.append(f"spec.pool.resourceSliceCount: Invalid value: {pool.get('resourceSliceCount')}: "
                      "must be greater than zero")  # fmt: skip
    if not isinstance(pool.get("generation", 0), int) or pool.get("generation", 0) < 0:
        errors.append(f"spec.pool.generation: Invalid value: {pool.get('generation')}: "
                      "must be greater than or equal to zero")  # fmt: skip
    selection = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(k)]
    if not selection:
        errors.append(f"spec: Required value: exactly one of {_NODE_FIELDS} is required")
    elif len(selection) > 1:
        errors.append(
            f'spec: Invalid value: "{{{", ".join(selection)}}}": exactly one of {_NODE_FIELDS} is required, '
            "but multiple fields are set"
        )
    devices = spec.get("devices") or []
    counters = spec.get("sharedCounters") or []
    if devices and counters:
        errors.append("spec: Invalid value: \"\": only one of 'sharedCounters' or 'devices' is allowed")
    if len(counters) > 8:
        errors.append(f"spec.sharedCounters: Too many: {len(counters)}: must have at most 8 items")
    for i, counter_set in enumerate(counters):
        errors.extend(_counter_errors(counter_set, f"spec.sharedCounters[{i}]"))
    tainted = any(d.get("taints") or d.get("consumesCounters") for d in devices if isinstance(d, dict))
    limit = 64 if any(isinstance(d, dict) and d.get("consumesCounters") for d in devices) else 128
    limit = taint_limit if (tainted and taint_limit and limit == 128) else limit
    if len(devices) > limit:
        errors.append(f"spec.devices: Too many: {len(devices)}: must have at most {limit} items")
    seen: set[str] = set()
    for i, device in enumerate(devices):
        errors.extend(_device_errors(device, f"spec.devices[{i}]", seen))
    if errors:
        raise _Invalid([f'ResourceSlice.{GROUP} "{name}" is invalid: ' + ("; ".join(errors) if len(errors) == 1
                        else "[" + ", ".join(errors) + "]")])  # fmt: skip


def _device_errors(device: Any, where: str, seen: set[str]) -> list[str]:
    errors: list[str] = []
    name = str(device.get("name") or "")
    if not name:
        errors.append(f"{where}.name: Required value")
    elif "." in name:
        errors.append(f'{where}.name: Invalid value: "{name}": must not contain dots')
    elif len(name) > 63 or not _DNS_LABEL.fullmatch(name):
        errors.append(f'{where}.name: Invalid value: "{name}": {_LABEL_MSG}')
    if name in seen:
        errors.append(f'{where}: Duplicate value: "{name}"')
    seen.add(name)
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    for key, value in attributes.items():
        at = f"{where}.attributes[{key}]"
        errors.extend(_key_errors(key, at))
        kinds = [k for k in ("int", "bool", "string", "version") if isinstance(value, dict) and k in value]
        if len(kinds) != 1:
            errors.append(f"{at}: Invalid value: {json.dumps(value)}: exactly one value must be specified")
            continue
        kind, v = kinds[0], value[kinds[0]]
        if kind in ("string", "version") and len(str(v).encode()) > 64:
            errors.append(f"{at}.{kind}: Too long: may not be more than 64 bytes")
        elif kind == "version" and not _SEMVER.fullmatch(str(v)):
            errors.append(f'{at}.version: Invalid value: "{v}": must be a string compatible with semver.org spec 2.0.0')
    for key, value in capacity.items():
        at = f"{where}.capacity[{key}]"
        errors.extend(_key_errors(key, at))
        quantity = str((value or {}).get("value", ""))
        if not _QUANTITY.fullmatch(quantity):
            errors.append(f'{at}.value: Invalid value: "{quantity}": quantities must match the regular expression')
    if len(attributes) + len(capacity) > 32:
        errors.append(
            f"{where}.attributes: Invalid value: {len(attributes) + len(capacity)}: "
            "the total number of attributes and capacities must not exceed 32"
        )
    consumes = device.get("consumesCounters") or []
    if len(consumes) > 2:
        errors.append(f"{where}.consumesCounters: Too many: {len(consumes)}: must have at most 2 items")
    for j, use in enumerate(consumes):
        errors.extend(_counter_errors({"name": use.get("counterSet"), **use}, f"{where}.consumesCounters[{j}]"))
    for key, value in capacity.items():
        policy = (value or {}).get("requestPolicy")
        if policy is not None:
            errors.extend(_policy_errors(policy, str(value.get("value")), device, f"{where}.capacity[{key}]"))
    for j, taint in enumerate(device.get("taints") or []):
        at = f"{where}.taints[{j}]"
        if taint.get("effect") not in ("NoSchedule", "NoExecute", "None"):
            errors.append(f'{at}.effect: Unsupported value: "{taint.get("effect")}"')
        if not _LABEL_VALUE.fullmatch(str(taint.get("value", ""))) or len(str(taint.get("value", ""))) > 63:
            errors.append(f'{at}.value: Invalid value: "{taint.get("value")}": a valid label must be ...')
        errors.extend(_key_errors(str(taint.get("key", "")), f"{at}.key", qualified_name=True))
    return errors


def _counter_errors(counter_set: dict[str, Any], where: str) -> list[str]:
    errors = []
    name = str(counter_set.get("name") or "")
    if not _DNS_LABEL.fullmatch(name):
        errors.append(f'{where}.name: Invalid value: "{name}": {_LABEL_MSG}')
    values = counter_set.get("counters") or {}
    if not values:
        errors.append(f"{where}.counters: Required value")
    if len(values) > 32:
        errors.append(f"{where}.counters: Too many: {len(values)}: must have at most 32 items")
    for key, value in values.items():
        if not _DNS_LABEL.fullmatch(key):
            errors.append(f'{where}.counters[{key}]: Invalid value: "{key}": {_LABEL_MSG}')
        if not _QUANTITY.fullmatch(str((value or {}).get("value", ""))):
            errors.append(f"{where}.counters[{key}].value: Required value")
    return errors


def _bytes(quantity: str) -> int:
    """The binary quantities the agent writes (``81559Mi``, ``1Gi``, ``12``), as bytes."""
    for suffix, shift in (("Ki", 10), ("Mi", 20), ("Gi", 30), ("Ti", 40)):
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) << shift
    return int(quantity)


def _policy_errors(policy: dict[str, Any], value: str, device: dict[str, Any], where: str) -> list[str]:
    """The request policy rules of validation.go (validateRequestPolicy...), for validRange policies."""
    if device.get("allowMultipleAllocations") is not True:
        return [f"{where}.requestPolicy: Forbidden: allowMultipleAllocations must be true"]
    valid = policy.get("validRange") or {}
    if "default" not in policy or "min" not in valid:
        return [f"{where}.requestPolicy: Required value: default and validRange.min"]
    total, default, low = _bytes(value), _bytes(policy["default"]), _bytes(valid["min"])
    step = _bytes(valid["step"]) if "step" in valid else 0
    errors = []
    if not low <= default <= total:
        errors.append(f"{where}.requestPolicy.default: Invalid value: must be between min and the capacity")
    if step and (low + step > total or (default - low) % step):
        errors.append(f"{where}.requestPolicy.validRange.step: Invalid value: does not fit the capacity or default")
    return errors


def _key_errors(key: str, where: str, *, qualified_name: bool = False) -> list[str]:
    domain, _, ident = key.rpartition("/")
    errors = []
    if domain and (len(domain) > 63 or not _DNS_SUBDOMAIN.fullmatch(domain)):
        errors.append(f'{where}: Invalid value: "{domain}": {_SUBDOMAIN_MSG}')
    if qualified_name:
        if not ident or len(ident) > 63 or not re.fullmatch(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]", ident):
            errors.append(f'{where}: Invalid value: "{key}": name part must consist of alphanumeric characters')
    elif len(ident) > 32:
        errors.append(f"{where}: Too long: may not be more than 32 bytes")
    elif not _C_IDENTIFIER.fullmatch(ident):
        errors.append(f'{where}: Invalid value: "{ident}": {_C_ID_MSG}')
    return errors
