"""Prometheus metrics read from the agent's live state at scrape time.

Nothing here counts on its own: the collector asks the health monitor, the ownership table,
the config state and the loop-lag probe when Prometheus scrapes, so the numbers cannot
drift from what /debug/state shows.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from agent.core.config.current import ConfigState
from agent.core.config.schema import Owner
from agent.core.health.model import HealthState
from agent.core.health.monitor import HealthMonitor
from agent.core.ownership.table import OwnershipState


class DeviceSource(Protocol):
    def gpu_uuids(self) -> list[str]: ...

    def inventory_problems(self) -> int: ...


class LoopLagProbe:
    """Measures how late the event loop wakes a timer; a busy or blocked loop shows here."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.last_lag_s = 0.0
        self.max_lag_s = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, loop.time() - started - self.interval_s)
            self.last_lag_s = lag
            self.max_lag_s = max(self.max_lag_s, lag)


class AgentCollector(Collector):
    def __init__(
        self,
        *,
        devices: DeviceSource,
        health: HealthMonitor,
        ownership: OwnershipState,
        config: ConfigState,
        loop_lag: LoopLagProbe,
    ) -> None:
        self._devices = devices
        self._health = health
        self._ownership = ownership
        self._config = config
        self._loop_lag = loop_lag
        self._started = time.time()

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        devices = GaugeMetricFamily(
            "gpu_agent_devices",
            "Physical GPUs on this node by granted owner (or draining:<from>-><to>) and health",
            labels=["owner", "health"],
        )
        counts: dict[tuple[str, str], int] = {(o.value, h.value): 0 for o in Owner for h in HealthState}
        table = self._ownership.current
        for uuid in self._devices.gpu_uuids():
            key = (table.state_of(uuid), self._health.state(uuid).value)
            counts[key] = counts.get(key, 0) + 1
        for (owner, health), n in sorted(counts.items()):
            devices.add_metric([owner, health], n)
        yield devices
        yield GaugeMetricFamily(
            "gpu_agent_draining_gpus",
            "GPUs moving between owners, waiting for the old owner's users to leave",
            value=table.drain_count(),
        )

        yield GaugeMetricFamily(
            "gpu_agent_inventory_problems",
            "Devices the backend saw but could not read at the last inventory read",
            value=self._devices.inventory_problems(),
        )

        transitions = CounterMetricFamily(
            "gpu_agent_health_transitions", "Device health transitions by new state", labels=["to"]
        )
        for state, n in self._health.transitions.items():
            transitions.add_metric([state.value], n)
        yield transitions

        yield CounterMetricFamily("gpu_agent_config_reloads", "Config updates applied live", value=self._config.reloads)
        yield CounterMetricFamily(
            "gpu_agent_config_rejections",
            "Config updates rejected (last good config kept)",
            value=self._config.rejections,
        )
        yield GaugeMetricFamily(
            "gpu_agent_loop_lag_seconds", "Event loop lag at the last probe", value=self._loop_lag.last_lag_s
        )
        yield GaugeMetricFamily(
            "gpu_agent_loop_lag_max_seconds", "Largest event loop lag seen", value=self._loop_lag.max_lag_s
        )
        yield GaugeMetricFamily("gpu_agent_start_time_seconds", "Unix time the agent started", value=self._started)
