"""The Kubernetes API client: JSON requests and watch streams over one HTTP/1.1 connection pool.

One :class:`KubeClient` serves the whole process (node labels, ResourceSlices, ResourceClaims,
Events); the composition root opens it as an async context manager (``agent/kube/session.py``)
and closes it at shutdown. The pool (``agent/kube/http.py``, asyncio streams) is created on first
use, inside the running loop.

Every request is bounded (issue 10 §2: nothing the API server sends may exhaust memory or
stall the loop):

* time: a total per request (30 s by default; callers with a deadline pass less), a connect
  limit, and for watches an idle limit on the socket instead of a total;
* size: a response body is streamed and reading stops past a per-request byte limit (an
  object 4 MiB: etcd keeps at most 1.5 MiB per object and JSON can be larger than the stored
  protobuf; a list 8 MiB; one watch event 4 MiB), so a 1.5 GB answer costs at most the limit;
  bodies are never compressed in transit (a small gzip body can inflate without bound);
* loop time: bodies over 256 KiB are decoded in a worker thread.

Errors are one-line :class:`KubeError` s naming verb, URL, status and the server's message cut
short; 404, 409 and 410 have their own types (``agent/kube/errors.py``). After a 401 the
credentials are read (or the exec plugin run) afresh and the request is sent once more.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote, quote_plus

from agent.kube.access import (
    SERVICE_ACCOUNT_DIR,
    ClusterAccess,
    in_cluster_access,
    kubeconfig_access,
    ssl_context,
)
from agent.kube.auth import Credentials, credentials_for
from agent.kube.errors import KubeConflictError, KubeError, KubeGoneError, KubeNotFoundError
from agent.kube.http import BodyTooLarge, ConnectTimeout, HttpError, HttpPool, Response, TlsError
from agent.kube.metrics import KubeMetrics

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
#: ask for metadata only (labels live there), fall back to the full object
METADATA_ACCEPT = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"
METADATA_LIST_ACCEPT = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"

MiB = 1024 * 1024
#: how much of an error body is read for its message
ERROR_BODY_BYTES = 16 * 1024
#: the longest server message quoted in an error
MESSAGE_CHARS = 400


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on every request; see the module docstring for why these numbers."""

    connect_timeout_s: float = 10.0
    request_timeout_s: float = 30.0
    object_bytes: int = 4 * MiB
    list_bytes: int = 8 * MiB
    watch_line_bytes: int = 4 * MiB
    #: the server is asked to end a watch after this long
    watch_timeout_s: float = 300.0
    #: a watch with no byte for this long is dropped; longer than ``watch_timeout_s``, after which
    #: the server ends the stream itself
    watch_idle_s: float = 330.0
    #: connections in the pool; each open watch holds one
    max_connections: int = 16
    #: bodies larger than this are decoded off the event loop
    thread_decode_bytes: int = 256 * 1024
    #: an idle pooled connection is kept this long (aiohttp's default was 15 s). The API server
    #: closes one after 90 s (k8s.io/apiserver pkg/server/secure_serving.go, IdleTimeout); each
    #: new one is a TLS handshake, and the claim reads of a NodePrepareResources run
    #: concurrently, one connection each: 8 handshakes cost 25 ms on the peers harness
    keepalive_s: float = 75.0


class KubeClient:
    """Requests against one API server, sharing one connection pool. Close it (or use ``async with``)."""

    def __init__(
        self,
        access: ClusterAccess,
        *,
        limits: Limits | None = None,
        metrics: KubeMetrics | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self.access = access
        self.limits = limits or Limits()
        self._metrics = metrics or KubeMetrics()
        self._credentials = credentials or credentials_for(access)
        self._ssl: ssl.SSLContext | None = ssl_context(access) if access.server.startswith("https:") else None
        self._session: HttpPool | None = None
        self._closed = False

    @classmethod
    def from_config(
        cls,
        kubeconfig: str,
        *,
        env: Mapping[str, str] | None = None,
        sa_dir: Path = SERVICE_ACCOUNT_DIR,
        limits: Limits | None = None,
        metrics: KubeMetrics | None = None,
    ) -> KubeClient:
        """From ``kubeconfig`` when set, else in-cluster. Raises KubeConfigError."""
        access = kubeconfig_access(kubeconfig) if kubeconfig else in_cluster_access(env=env, sa_dir=sa_dir)
        return cls(access, limits=limits, metrics=metrics)

    @property
    def server(self) -> str:
        return self.access.server

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the pool; idempotent. Requests after this fail with a KubeError."""
        self._closed = True
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    def _pool(self) -> HttpPool:
        if self._closed:
            raise KubeError(f"{self.server}: the API client is closed")
        if self._session is None:
            self._session = HttpPool(
                self.server,
                ssl_context=self._ssl,
                max_connections=self.limits.max_connections,
                keepalive_s=self.limits.keepalive_s,
                connect_timeout_s=self.limits.connect_timeout_s,
            )
        return self._session

    # --- verbs -----------------------------------------------------------------------

    async def get(
        self,
        path: str,
        params: Mapping[str, str] | None = None,
        *,
        accept: str = JSON,
        timeout_s: float | None = None,
        max_bytes: int | None = None,
    ) -> dict[str, Any]:
        """GET one object (or anything small). Raises KubeError naming the URL."""
        return await self._call(
            "get", "GET", path, params, None, accept=accept, timeout_s=timeout_s, max_bytes=max_bytes
        )

    async def list(
        self,
        path: str,
        params: Mapping[str, str] | None = None,
        *,
        accept: str = JSON,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """GET a collection (bounded by ``limits.list_bytes``)."""
        return await self._call(
            "list", "GET", path, params, None, accept=accept, timeout_s=timeout_s, max_bytes=self.limits.list_bytes
        )

    async def create(
        self, path: str, body: Mapping[str, Any], params: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """POST ``body`` to a collection; returns the stored object."""
        return await self._call("create", "POST", path, params, body)

    async def replace(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """PUT ``body`` (with ``metadata.resourceVersion`` for a conditional update)."""
        return await self._call("update", "PUT", path, None, body)

    async def patch(self, path: str, body: Mapping[str, Any], *, content_type: str = MERGE_PATCH) -> dict[str, Any]:
        return await self._call("patch", "PATCH", path, None, body, content_type=content_type)

    async def delete(self, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """DELETE, optionally with DeleteOptions (preconditions)."""
        return await self._call("delete", "DELETE", path, None, body)

    async def _call(
        self,
        verb: str,
        method: str,
        path: str,
        params: Mapping[str, str] | None,
        body: Mapping[str, Any] | None,
        *,
        accept: str = JSON,
        content_type: str = JSON,
        timeout_s: float | None = None,
        max_bytes: int | None = None,
    ) -> dict[str, Any]:
        target = _target(path, params)
        limit = max_bytes or self.limits.object_bytes
        total_s = timeout_s or self.limits.request_timeout_s
        data = None if body is None else json.dumps(body).encode()
        where = f"{method} {self.server}{target}"
        started = time.monotonic()
        result = "ok"
        try:
            headers = await self._headers(accept)
            if data is not None:
                headers["Content-Type"] = content_type
            for attempt in (1, 2):
                async with asyncio.timeout(total_s), self._pool().request(method, target, headers, data) as resp:
                    if resp.status == 401 and attempt == 1 and await self._renewed(headers):
                        continue  # the 401's body is left unread: its connection is closed
                    await _raise_for_status(where, resp)
                    raw = await _read_limited(where, resp, limit)
                break
            return await self._decode(where, raw)
        except KubeError as exc:
            result = _result_of(exc)
            raise
        except (OSError, TimeoutError, ValueError, HttpError) as exc:
            error = _connection_error(where, exc, self.limits.connect_timeout_s if _connecting(exc) else total_s)
            result = _result_of(error)
            raise error from exc
        finally:
            self._metrics.observe(verb, resource_of(path), result, time.monotonic() - started)

    async def watch(
        self,
        path: str,
        params: Mapping[str, str] | None = None,
        *,
        timeout_s: float | None = None,
        accept: str = JSON,
        on_open: Callable[[], None] | None = None,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Yield watch events (``{"type", "object"}``) until the server ends the stream.

        The server is asked to end it after ``timeout_s``; a socket silent for
        ``limits.watch_idle_s`` is dropped. An ``ERROR`` event becomes a KubeError
        (KubeGoneError for 410). ``on_open`` is called once the server has accepted the watch
        (before any event). Use with ``contextlib.aclosing`` so that leaving the loop early
        closes the connection.
        """
        timeout_s = timeout_s or self.limits.watch_timeout_s
        query = {**(params or {}), "watch": "true", "timeoutSeconds": str(max(1, int(timeout_s)))}
        target = _target(path, query)
        where = f"watch {self.server}{target}"
        idle = self.limits.watch_idle_s
        started = time.monotonic()
        opened = False
        try:
            headers = await self._headers(accept)
            async with self._pool().request("GET", target, headers, read_idle_s=idle) as resp:
                if resp.status == 401 and await self._renewed(headers):
                    raise KubeError(f"{where}: 401 Unauthorized (credentials renewed; retry)", recoverable=True)
                await _raise_for_status(where, resp)
                opened = True
                self._metrics.observe("watch", resource_of(path), "ok", time.monotonic() - started)
                if on_open is not None:
                    on_open()
                async for line in _lines(where, resp, self.limits.watch_line_bytes):
                    yield await self._event(where, line)
        except KubeError as exc:
            if not opened:
                self._metrics.observe("watch", resource_of(path), _result_of(exc), time.monotonic() - started)
            raise
        except (OSError, TimeoutError, ValueError, HttpError) as exc:
            error = _connection_error(where, exc, self.limits.connect_timeout_s if _connecting(exc) else idle)
            if not opened:
                self._metrics.observe("watch", resource_of(path), _result_of(error), time.monotonic() - started)
            raise error from exc

    # --- helpers -----------------------------------------------------------------------

    async def _headers(self, accept: str) -> dict[str, str]:
        headers = {"Accept": accept}
        authorization = await self._credentials.header()
        if authorization:
            headers["Authorization"] = authorization
        return headers

    async def _renewed(self, headers: dict[str, str]) -> bool:
        """After a 401: put fresh credentials in ``headers``; whether they differ (then retry once)."""
        self._credentials.expire()
        fresh = await self._credentials.header()
        if fresh == headers.get("Authorization", ""):
            return False
        headers["Authorization"] = fresh
        return True

    async def _decode(self, where: str, raw: bytes) -> dict[str, Any]:
        if len(raw) > self.limits.thread_decode_bytes:
            body = await asyncio.to_thread(_loads, where, raw)
        else:
            body = _loads(where, raw)
        if not isinstance(body, dict):
            raise KubeError(f"{where}: expected a JSON object, got {type(body).__name__}", recoverable=True)
        return body

    async def _event(self, where: str, line: bytes) -> dict[str, Any]:
        event = await self._decode(where, line)
        if not isinstance(event.get("object"), dict) or not isinstance(event.get("type"), str):
            raise KubeError(f"{where}: malformed event {line[:80]!r}", recoverable=True)
        if event["type"] == "ERROR":
            status = event["object"]
            code = status.get("code")
            text = f"{where}: {code} {status.get('reason', '')}: {_cut(str(status.get('message', '')))}"
            if code == 410:
                raise KubeGoneError(text)
            raise KubeError(
                text,
                status=code if isinstance(code, int) else None,
                recoverable=not isinstance(code, int) or code >= 500 or code == 429,
            )
        return event


def resource_of(path: str) -> str:
    """The resource a request path names, for metrics: ``/apis/g/v/namespaces/ns/things/x`` -> ``things``."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    if parts[:1] == ["api"]:
        parts = parts[2:]
    elif parts[:1] == ["apis"]:
        parts = parts[3:]
    if len(parts) >= 3 and parts[0] == "namespaces":
        parts = parts[2:]
    return parts[0] if parts else "discovery"


def _loads(where: str, raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise KubeError(f"{where}: undecodable JSON: {_cut(str(exc))}", recoverable=True) from exc


def _target(path: str, params: Mapping[str, str] | None) -> str:
    """Path and query as sent: characters a path may not hold escaped (``%`` escapes kept), query
    values form-encoded (RFC 3986 section 3.3 and 3.4)."""
    target = quote(path, safe="/%:@!$&'()*+,;=~")
    if params:
        query = "&".join(
            f"{quote_plus(k, safe=_QUERY_SAFE)}={quote_plus(v, safe=_QUERY_SAFE)}" for k, v in params.items()
        )
        target += ("&" if "?" in target else "?") + query
    return target


#: left as they are in query keys and values (what yarl, the URL library used before, left)
_QUERY_SAFE = "!$'()*,/:;?@~"


async def _read_limited(where: str, resp: Response, limit: int) -> bytes:
    try:
        return await resp.read(limit)
    except BodyTooLarge as exc:
        if exc.declared is not None:
            text = f"{where}: response of {exc.declared} bytes is over the limit of {limit} bytes"
        else:
            text = f"{where}: response is over the limit of {limit} bytes; stopped reading"
        raise KubeError(text, recoverable=True) from exc


async def _lines(where: str, resp: Response, limit: int) -> AsyncGenerator[bytes, None]:
    """Newline-separated lines of a watch stream, each at most ``limit`` bytes."""
    buffer = bytearray()
    async for chunk in resp.chunks():
        start = len(buffer)
        buffer += chunk
        while (end := buffer.find(b"\n", start)) >= 0:
            if end > limit:
                break
            line = bytes(buffer[:end])
            del buffer[: end + 1]
            start = 0
            if line.strip():
                yield line
        if len(buffer) > limit:
            raise KubeError(f"{where}: event longer than {limit} bytes", recoverable=True)
    if bytes(buffer).strip():
        yield bytes(buffer)


async def _raise_for_status(where: str, resp: Response) -> None:
    if resp.status < 400:
        return
    text = ""
    with contextlib.suppress(OSError, ValueError, TimeoutError, HttpError):
        text = (await resp.read_some(ERROR_BODY_BYTES)).decode(errors="replace")
    status = _status_of(text)
    message = str(status.get("message") or "") if status else text
    line = f"{where}: {resp.status} {resp.reason or ''}".rstrip()
    if message.strip():
        line += ": " + _cut(message)
    if resp.status == 404:
        # a missing object comes with a Status naming it; an unserved path with a bare 404
        details = status.get("details") if status else None
        raise KubeNotFoundError(line, object_missing=isinstance(details, dict) and bool(details.get("name")))
    if resp.status == 409:
        raise KubeConflictError(line)
    if resp.status == 410:
        raise KubeGoneError(line)
    raise KubeError(line, status=resp.status, recoverable=resp.status >= 500 or resp.status == 429)


def _status_of(text: str) -> dict[str, Any] | None:
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) and body.get("kind") == "Status" else None


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS] + "…"


def _result_of(exc: KubeError) -> str:
    if exc.status is not None:
        return str(exc.status)
    message = str(exc)
    if "no answer within" in message or "timed out" in message:
        return "timeout"
    if "over the limit" in message or "longer than" in message:
        return "too-large"
    return "connection"


def _connection_error(where: str, exc: BaseException, timeout_s: float | None) -> KubeError:
    if isinstance(exc, TimeoutError):
        within = f" within {timeout_s:g}s" if timeout_s else ""
        kind = "could not connect" if isinstance(exc, ConnectTimeout) else "no answer"
        return KubeError(f"{where}: {kind}{within} (timed out)", recoverable=True)
    detail = str(exc) or type(exc).__name__
    # a certificate the server will keep presenting is not fixed by retrying
    return KubeError(f"{where}: {type(exc).__name__}: {_cut(detail)}", recoverable=not isinstance(exc, TlsError))


def _connecting(exc: BaseException) -> bool:
    """Whether a request failed in its connect (then its message names the connect limit)."""
    return isinstance(exc, ConnectTimeout)
