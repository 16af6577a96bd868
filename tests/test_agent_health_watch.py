"""The agent moves the backend's health watch to each new inventory without a gap."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from agent.backends.simulated import SimulatedBackend
from agent.cdi.service import NullCdiService
from agent.core.config.current import ConfigState
from agent.core.config.loader import load_config
from agent.core.config.schema import HealthConfig
from agent.core.health.monitor import HealthMonitor
from agent.core.inventory.current import InventoryState
from agent.core.node import NodeFacts
from agent.core.ownership.table import OwnershipState
from agent.runtime.assemble import build_agent
from tests.test_plugin_fakes import wait_for


async def test_injections_never_fail_while_the_watch_moves_to_a_new_inventory() -> None:
    health = HealthConfig(check_interval_s=3600)
    backend = SimulatedBackend(preset="h100-8x-nvlink", node_name="n", health=health)
    inventory = await backend.load()
    monitor = HealthMonitor(config=health)
    monitor.set_inventory(inventory)
    agent = build_agent(
        config_state=ConfigState(load_config(None)),
        node_name="n",
        backend=backend,
        node=NodeFacts(inventory=InventoryState(inventory), health=monitor, ownership=OwnershipState()),
        cdi=NullCdiService(),
        mechanisms={},
        registry=CollectorRegistry(),
    )
    task = asyncio.create_task(agent.watch_health())
    try:
        await wait_for(lambda: backend._emit is not None, what="the first health watch")
        for round_ in range(20):
            agent.apply_inventory(replace(inventory, driver_version=f"570.{round_}"))
            for _ in range(5):  # several loop steps of the hand-over (the check holds at every one)
                backend.inject("0", healthy=True)  # raises if no watch is running
                await asyncio.sleep(0)
        assert not task.done()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
