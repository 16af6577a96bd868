"""aiohttp debug endpoint: /healthz, /readyz, /metrics, /debug/state, and the simulated-health hook.

Handlers reach the agent only through the :class:`DebugContext` stored under a typed
``web.AppKey``; they never import the components themselves.
"""

from __future__ import annotations

import errno
import json
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from agent.errors import AgentError, DeviceNotFoundError, StartupError
from agent.health.model import Signal
from agent.mechanism import Readiness

log = structlog.get_logger("agent.debug")


class SimulatedControl(Protocol):
    def inject(self, device: str, *, healthy: bool, xid: int | None = None) -> Signal: ...


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


CONTEXT = web.AppKey("context", DebugContext)


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


async def simulated_health(request: web.Request) -> web.Response:
    control = request.app[CONTEXT].simulated
    if control is None:  # pragma: no cover - the route is only added with a control
        raise web.HTTPNotFound()
    try:
        body = await request.json()
    except (ValueError, RecursionError):
        return _bad_request('body must be JSON like {"device": "0", "healthy": false, "xid": 79}')
    if not isinstance(body, dict):
        return _bad_request("body must be a JSON object")
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


def build_app(context: DebugContext) -> web.Application:
    app = web.Application()
    app[CONTEXT] = context
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/state", debug_state)
    if context.simulated is not None:
        app.router.add_post("/debug/simulated/health", simulated_health)
    return app


@asynccontextmanager
async def serve_debug(context: DebugContext, host: str, port: int) -> AsyncIterator[int]:
    """Serve until the context exits; yields the bound port (useful with port 0)."""
    runner = web.AppRunner(build_app(context), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
            raise StartupError(f"debug endpoint cannot listen on {host}:{port}: {reason}") from exc
        sockets = getattr(site._server, "sockets", None) or []
        bound = int(sockets[0].getsockname()[1]) if sockets else port
        log.info("debug endpoint listening", addr=f"{host}:{bound}")
        yield bound
    finally:
        await runner.cleanup()
