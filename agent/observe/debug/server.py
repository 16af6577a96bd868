"""The debug endpoint: /healthz, /readyz, /metrics, /debug/state, and the simulated backend's hooks.

Handlers reach the agent only through the :class:`DebugContext` they are bound to; they never
import the components themselves. The HTTP is :mod:`agent.observe.debug.http` (asyncio streams,
no aiohttp: about 8 MiB less resident memory).

What a client can make it do is bounded by :class:`HttpLimits`: request line and headers (sizes
and count), the body (413 past it, refused by its ``Content-Length`` before any of it is read),
the time a body may take to arrive, how long a connection may sit without a complete request
(1,000 half-sent requests used to stay open for an hour each), and how many connections are open
at once (a new one displaces the quietest idle one, so a flood of silent connections never locks
out a probe; 503 only when every open connection is answering a request).
"""

from __future__ import annotations

import errno
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from agent.base.errors import AgentError, DeviceNotFoundError, StartupError
from agent.core.health.model import Signal
from agent.core.mechanism import Readiness
from agent.observe.debug.http import (
    Handler,
    HttpLimits,
    HttpServer,
    Request,
    Response,
    Routes,
    json_response,
    text_response,
)

__all__ = ["DebugContext", "HttpLimits", "SimulatedControl", "build_routes", "serve_debug"]

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


def _dumps(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=False, default=str)


async def healthz(context: DebugContext, request: Request) -> Response:
    return text_response("ok\n")


async def readyz(context: DebugContext, request: Request) -> Response:
    checks = context.readiness()
    ready = all(check.ok for check in checks.values())
    body = {
        "ready": ready,
        "status": context.status(),
        "checks": {name: c.detail or ("ok" if c.ok else "not ready") for name, c in checks.items()},
    }
    return json_response(body, status=200 if ready else 503, dumps=_dumps)


async def metrics(context: DebugContext, request: Request) -> Response:
    return Response(200, generate_latest(context.registry), CONTENT_TYPE_LATEST)


async def debug_state(context: DebugContext, request: Request) -> Response:
    return json_response(context.state(), dumps=_dumps)


def _bad_request(message: str) -> Response:
    return json_response({"error": message}, status=400)


async def _simulated_request(
    context: DebugContext, request: Request, example: str
) -> tuple[SimulatedControl, dict[str, Any]] | Response:
    """The simulated backend's hooks and the request's JSON object, or the error response to send."""
    control = context.simulated
    if control is None:  # pragma: no cover - the routes are only added with a control
        return text_response("404: Not Found", 404)
    try:
        body = await request.json()  # the body's size and time are bounded by the server
    except TimeoutError:
        return json_response({"error": "request body not received in time"}, status=408)
    except (ValueError, RecursionError):
        return _bad_request(f"body must be JSON like {example}")
    if not isinstance(body, dict):
        return _bad_request("body must be a JSON object")
    return control, body


async def simulated_health(context: DebugContext, request: Request) -> Response:
    got = await _simulated_request(context, request, '{"device": "0", "healthy": false, "xid": 79}')
    if isinstance(got, Response):
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
        return json_response({"error": str(exc)}, status=404)
    except AgentError as exc:
        return json_response({"error": str(exc)}, status=409)
    log.info("simulated health injected", uuid=signal.uuid, healthy=healthy, xid=xid)
    return json_response({"device": signal.uuid, "signal": signal.kind.value, "xid": signal.xid})


async def simulated_mig(context: DebugContext, request: Request) -> Response:
    """``{"op": "create"|"destroy", "kind": "<PartitionErrorKind>", "device": "<GPU>", "count": N}``:
    the next ``count`` such MIG operations (on that GPU; any GPU without ``device``) fail."""
    example = '{"op": "create", "kind": "insufficient-resources", "device": "0"}'
    got = await _simulated_request(context, request, example)
    if isinstance(got, Response):
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
        return json_response({"error": str(exc)}, status=404)
    except ValueError as exc:
        return _bad_request(str(exc))
    return json_response(answer)


_Bound = Callable[[DebugContext, Request], Awaitable[Response]]


def build_routes(context: DebugContext) -> Routes:
    """Path -> method -> handler bound to ``context``; the simulated hooks only with a control."""

    def bind(handler: _Bound) -> Handler:
        async def bound(request: Request) -> Response:
            return await handler(context, request)

        return bound

    routes: dict[str, dict[str, Handler]] = {
        "/healthz": {"GET": bind(healthz)},
        "/readyz": {"GET": bind(readyz)},
        "/metrics": {"GET": bind(metrics)},
        "/debug/state": {"GET": bind(debug_state)},
    }
    if context.simulated is not None:
        routes["/debug/simulated/health"] = {"POST": bind(simulated_health)}
        routes["/debug/simulated/mig"] = {"POST": bind(simulated_mig)}
    return routes


@asynccontextmanager
async def serve_debug(
    context: DebugContext, host: str, port: int, limits: HttpLimits | None = None
) -> AsyncIterator[int]:
    """Serve until the context exits; yields the bound port (useful with port 0)."""
    server = HttpServer(build_routes(context), limits or HttpLimits(), name="debug")
    try:
        try:
            bound = await server.start(host, port)
        except OSError as exc:
            reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
            raise StartupError(f"debug endpoint cannot listen on {host}:{port}: {reason}") from exc
        log.info("debug endpoint listening", addr=f"{host}:{bound}")
        yield bound
    finally:
        await server.close()
