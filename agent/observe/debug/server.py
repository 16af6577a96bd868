"""aiohttp debug endpoint: /healthz, /readyz, /metrics, /debug/state, and the simulated backend's hooks.

Handlers reach the agent only through the :class:`DebugContext` stored under a typed
``web.AppKey``; they never import the components themselves.

What a client can make it do is bounded by :class:`HttpLimits`: request line and headers (sizes
and count), the body (``client_max_size``: 413 past it), the time a body may take to arrive, how
long a connection may sit without a complete request (1,000 half-sent requests used to stay open
for an hour each), and how many connections are open at once (a new one displaces the quietest
idle one, so a flood of silent connections never locks out a probe; 503 only when every open
connection is answering a request).
"""

from __future__ import annotations

import asyncio
import errno
import json
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from agent.base.errors import AgentError, DeviceNotFoundError, StartupError
from agent.core.health.model import Signal
from agent.core.mechanism import Readiness
from agent.grpc.connections import CappedProtocol, ConnectionCap

log = structlog.get_logger("agent.debug")


class SimulatedControl(Protocol):
    def inject(self, device: str, *, healthy: bool, xid: int | None = None) -> Signal: ...

    def inject_mig_failure(
        self, op: str, kind: str, *, device: str | None = None, count: int = 1
    ) -> dict[str, object]: ...


@dataclass(frozen=True, slots=True)
class DebugContext:
    #: JSON-ready snapshot of the agent for /debug/state
    state: Callable[[], dict[str, Any]]
    #: check name -> result; the detail says why not, or notes something worth knowing
    readiness: Callable[[], Mapping[str, Readiness]]
    #: "serving" or "no devices"
    status: Callable[[], str]
    registry: CollectorRegistry
    #: present only when the simulated backend is active; the route does not exist otherwise
    simulated: SimulatedControl | None = None


@dataclass(frozen=True, slots=True)
class HttpLimits:
    #: the only body is the simulated-health JSON, a few dozen bytes
    max_body_bytes: int = 64 * 1024
    body_timeout_s: float = 5.0
    #: a connection without a complete request (silent, half-sent, idle keep-alive) is closed
    idle_timeout_s: float = 15.0
    #: probes, a Prometheus scrape and a person with curl need a handful
    max_connections: int = 64
    max_line_bytes: int = 8190
    max_header_bytes: int = 8190
    max_headers: int = 32


CONTEXT = web.AppKey("context", DebugContext)
LIMITS = web.AppKey("limits", HttpLimits)
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 25\r\n"
    b"Connection: close\r\n\r\ntoo many open connections"
)


def _dumps(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=False, default=str)


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    context = request.app[CONTEXT]
    checks = context.readiness()
    ready = all(check.ok for check in checks.values())
    body = {
        "ready": ready,
        "status": context.status(),
        "checks": {name: c.detail or ("ok" if c.ok else "not ready") for name, c in checks.items()},
    }
    return web.json_response(body, status=200 if ready else 503, dumps=_dumps)


async def metrics(request: web.Request) -> web.Response:
    payload = generate_latest(request.app[CONTEXT].registry)
    return web.Response(body=payload, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def debug_state(request: web.Request) -> web.Response:
    return web.json_response(request.app[CONTEXT].state(), dumps=_dumps)


def _bad_request(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


async def _simulated_request(
    request: web.Request, example: str
) -> tuple[SimulatedControl, dict[str, Any]] | web.Response:
    """The simulated backend's hooks and the request's JSON object, or the error response to send."""
    control = request.app[CONTEXT].simulated
    if control is None:  # pragma: no cover - the routes are only added with a control
        raise web.HTTPNotFound()
    try:
        async with asyncio.timeout(request.app[LIMITS].body_timeout_s):
            body = await request.json()
    except TimeoutError:
        return web.json_response({"error": "request body not received in time"}, status=408)
    except (ValueError, RecursionError):
        return _bad_request(f"body must be JSON like {example}")
    if not isinstance(body, dict):
        return _bad_request("body must be a JSON object")
    return control, body


async def simulated_health(request: web.Request) -> web.Response:
    got = await _simulated_request(request, '{"device": "0", "healthy": false, "xid": 79}')
    if isinstance(got, web.Response):
        return got
    control, body = got
    device, healthy, xid = body.get("device"), body.get("healthy"), body.get("xid")
    if isinstance(device, int) and not isinstance(device, bool):
        device = str(device)
    if not isinstance(device, str) or not device or len(device) > 256:
        return _bad_request("'device' must be a GPU UUID, MIG UUID or index")
    if not isinstance(healthy, bool):
        return _bad_request("'healthy' must be true or false")
    if xid is not None and (not isinstance(xid, int) or isinstance(xid, bool) or xid < 0):
        return _bad_request("'xid' must be a non-negative integer")
    try:
        signal = control.inject(device, healthy=healthy, xid=xid)
    except DeviceNotFoundError as exc:
        return web.json_response({"error": str(exc)}, status=404)
    except AgentError as exc:
        return web.json_response({"error": str(exc)}, status=409)
    log.info("simulated health injected", uuid=signal.uuid, healthy=healthy, xid=xid)
    return web.json_response({"device": signal.uuid, "signal": signal.kind.value, "xid": signal.xid})


async def simulated_mig(request: web.Request) -> web.Response:
    """``{"op": "create"|"destroy", "kind": "<PartitionErrorKind>", "device": "<GPU>", "count": N}``:
    the next ``count`` such MIG operations (on that GPU; any GPU without ``device``) fail."""
    got = await _simulated_request(request, '{"op": "create", "kind": "insufficient-resources", "device": "0"}')
    if isinstance(got, web.Response):
        return got
    control, body = got
    op, kind, device, count = body.get("op"), body.get("kind"), body.get("device", None), body.get("count", 1)
    if isinstance(device, int) and not isinstance(device, bool):
        device = str(device)
    if not isinstance(op, str) or not isinstance(kind, str) or len(op) > 32 or len(kind) > 32:
        return _bad_request("'op' and 'kind' must be short strings")
    if device is not None and (not isinstance(device, str) or not device or len(device) > 256):
        return _bad_request("'device' must be a GPU UUID or index")
    if not isinstance(count, int) or isinstance(count, bool):
        return _bad_request("'count' must be an integer")
    try:
        answer = control.inject_mig_failure(op, kind, device=device, count=count)
    except DeviceNotFoundError as exc:
        return web.json_response({"error": str(exc)}, status=404)
    except ValueError as exc:
        return _bad_request(str(exc))
    return web.json_response(answer)


@web.middleware
async def _declared_size(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A body announced larger than the limit is refused before any of it is read."""
    limit = request.app[LIMITS].max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    return await handler(request)


def build_app(context: DebugContext, limits: HttpLimits | None = None) -> web.Application:
    limits = limits or HttpLimits()
    app = web.Application(client_max_size=limits.max_body_bytes, middlewares=[_declared_size])
    app[CONTEXT] = context
    app[LIMITS] = limits
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/state", debug_state)
    if context.simulated is not None:
        app.router.add_post("/debug/simulated/health", simulated_health)
        app.router.add_post("/debug/simulated/mig", simulated_mig)
    return app


class _HttpConnection(CappedProtocol):
    def busy(self) -> bool:
        # aiohttp's handler holds the request it is answering (no public accessor)
        return self.admitted and getattr(self._inner, "_current_request", None) is not None


class _Site(web.BaseSite):
    """A TCP site whose connections are capped (aiohttp's own TCPSite accepts any number)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, cap: ConnectionCap) -> None:
        super().__init__(runner)
        self._host, self._port, self._cap = host, port, cap

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _HttpConnection(server(), self._cap), self._host, self._port, reuse_address=True
        )

    def bound_port(self) -> int:
        sockets = getattr(self._server, "sockets", None) or ()
        return int(sockets[0].getsockname()[1]) if sockets else self._port


@asynccontextmanager
async def serve_debug(
    context: DebugContext, host: str, port: int, limits: HttpLimits | None = None
) -> AsyncIterator[int]:
    """Serve until the context exits; yields the bound port (useful with port 0)."""
    limits = limits or HttpLimits()
    runner = web.AppRunner(
        build_app(context, limits),
        access_log=None,
        handle_signals=False,
        keepalive_timeout=limits.idle_timeout_s,
        max_line_size=limits.max_line_bytes,
        max_field_size=limits.max_header_bytes,
        max_headers=limits.max_headers,
        # after an early answer (413, 408) the rest of a body is drained this long, not 10 s
        lingering_time=1.0,
        # open requests get this long at shutdown, well inside the agent's own deadline
        shutdown_timeout=1.0,
    )
    await runner.setup()
    try:
        site = _Site(runner, host, port, ConnectionCap(limits.max_connections, name="debug", refusal=_BUSY))
        try:
            await site.start()
        except OSError as exc:
            reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
            raise StartupError(f"debug endpoint cannot listen on {host}:{port}: {reason}") from exc
        bound = site.bound_port()
        log.info("debug endpoint listening", addr=f"{host}:{bound}")
        yield bound
    finally:
        await runner.cleanup()
