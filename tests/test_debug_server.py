from __future__ import annotations

import socket
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from agent.base.errors import AgentError, DeviceNotFoundError, StartupError
from agent.core.health.model import Signal, SignalKind
from agent.core.mechanism import Readiness
from agent.observe.debug.server import DebugContext, serve_debug
from tests.conftest import DebugClient


class FakeSim:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bool, int | None]] = []

    def inject(self, device: str, *, healthy: bool, xid: int | None = None) -> Signal:
        if device == "missing":
            raise DeviceNotFoundError("no GPU 'missing' on this node")
        if device == "early":
            raise AgentError("health monitor not running")
        self.calls.append((device, healthy, xid))
        kind = SignalKind.INJECTED_HEAL if healthy else SignalKind.XID if xid else SignalKind.INJECTED_FAULT
        return Signal(uuid="GPU-0", kind=kind, xid=xid)


def _context(ready: dict[str, Readiness] | None = None, sim: FakeSim | None = None) -> DebugContext:
    registry = CollectorRegistry()
    Counter("gpu_agent_example", "example", registry=registry).inc()
    return DebugContext(
        state=lambda: {"devices": [], "config": {"version": "v", "source": "defaults", "last_error": ""}},
        readiness=lambda: ready if ready is not None else {"inventory": Readiness(True)},
        status=lambda: "no devices",
        registry=registry,
        simulated=sim,
    )


async def test_probes_metrics_and_state(debug_client: DebugClient) -> None:
    client = await debug_client(_context())
    assert (await client.get("/healthz")).status == 200
    resp = await client.get("/readyz")
    assert resp.status == 200
    assert (await resp.json()) == {"ready": True, "status": "no devices", "checks": {"inventory": "ok"}}
    resp = await client.get("/metrics")
    assert "gpu_agent_example_total 1.0" in await resp.text()
    state = await (await client.get("/debug/state")).json()
    assert state["config"]["version"] == "v"


async def test_readyz_reports_failing_checks(debug_client: DebugClient) -> None:
    checks = {
        "inventory": Readiness(True),
        "device-plugin": Readiness(False, "not registered"),
        "cdi": Readiness(True, "a note"),
    }
    client = await debug_client(_context(checks))
    resp = await client.get("/readyz")
    assert resp.status == 503
    body = await resp.json()
    assert body["checks"] == {"inventory": "ok", "device-plugin": "not registered", "cdi": "a note"}


async def test_simulated_route_absent_without_simulated_backend(debug_client: DebugClient) -> None:
    client = await debug_client(_context())
    resp = await client.post("/debug/simulated/health", json={"device": "0", "healthy": False})
    assert resp.status == 404


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        ({"device": "0", "healthy": "no"}, 400, "'healthy' must be true or false"),
        ({"healthy": False}, 400, "'device' must be"),
        ({"device": "0", "healthy": False, "xid": -1}, 400, "'xid' must be a non-negative integer"),
        ([1, 2], 400, "body must be a JSON object"),
        ({"device": "missing", "healthy": False}, 404, "no GPU 'missing'"),
        ({"device": "early", "healthy": False}, 409, "health monitor not running"),
    ],
)
async def test_simulated_health_rejects_bad_requests(
    debug_client: DebugClient, body: Any, status: int, error: str
) -> None:
    client = await debug_client(_context(sim=FakeSim()))
    resp = await client.post("/debug/simulated/health", json=body)
    assert resp.status == status
    assert error in (await resp.json())["error"]


async def test_simulated_health_injects(debug_client: DebugClient) -> None:
    sim = FakeSim()
    client = await debug_client(_context(sim=sim))
    resp = await client.post("/debug/simulated/health", json={"device": 0, "healthy": False, "xid": 79})
    assert resp.status == 200
    assert (await resp.json()) == {"device": "GPU-0", "signal": "xid", "xid": 79}
    assert sim.calls == [("0", False, 79)]
    resp = await client.post("/debug/simulated/health", data=b"not json")
    assert resp.status == 400


async def test_port_in_use_is_one_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StartupError, match=f"cannot listen on 127.0.0.1:{port}: address already in use"):
            async with serve_debug(_context(), "127.0.0.1", port):
                pass


async def test_serve_on_port_zero_reports_the_bound_port() -> None:
    async with serve_debug(_context(), "127.0.0.1", 0) as port:
        assert port > 0


async def test_absurd_bodies_are_400_not_500(debug_client: DebugClient) -> None:
    client = await debug_client(_context(sim=FakeSim()))
    resp = await client.post("/debug/simulated/health", data=b"[" * 30_000 + b"]" * 30_000)
    assert resp.status == 400
    resp = await client.post("/debug/simulated/health", data=b"[" * 100_000 + b"]" * 100_000)
    assert resp.status == 413  # past client_max_size: never read whole
    resp = await client.post("/debug/simulated/health", json={"device": "9" * 5000, "healthy": False})
    assert resp.status == 400


def test_inventory_lookup_by_odd_index_strings_finds_nothing() -> None:
    from agent.core.inventory.model import Gpu, Inventory

    gpu = Gpu(
        uuid="GPU-a",
        index=2,
        minor=2,
        product_name="p",
        architecture="a",
        compute_capability="9.0",
        memory_mib=1,
        pci_bus_id="00000000:01:00.0",
        numa_node=None,
    )
    inventory = Inventory(backend="t", driver_version="1", cuda_driver_version="1", gpus=(gpu,))
    assert inventory.find("2") is gpu
    for key in ("²", "٢", "9" * 5000, "-2", " 2"):
        assert inventory.find(key) is None
