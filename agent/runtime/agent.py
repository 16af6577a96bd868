"""The running agent: its components, and the derived per-node state it keeps consistent.

:class:`Agent` is built by the composition root (:func:`agent.runtime.assemble.build_agent`) from
components that already exist, and is read by the debug endpoint and by tests. When the
inventory, the config or the node's labels change, it updates health tracking and the ownership
it hands to the handover first and then publishes the new inventory, so a consumer woken by a
change reads a consistent picture.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import structlog

from agent.backends.backend import Backend
from agent.base.errors import AgentError
from agent.base.logs import set_level
from agent.cdi.service import CdiProvider
from agent.core.config.current import ConfigState
from agent.core.config.loader import LoadedConfig
from agent.core.config.node import uses_label_rules
from agent.core.config.schema import Config
from agent.core.inventory.model import Inventory
from agent.core.mechanism import Mechanism, Readiness
from agent.core.node import NodeFacts
from agent.core.ownership.handover import Handover
from agent.core.ownership.plan import plan_rows
from agent.core.ownership.table import OwnershipTable, compute_ownership
from agent.kube.labels import NodeLabelSource, StaticLabelSource
from agent.observe.debug.document import agent_state
from agent.observe.debug.server import SimulatedControl
from agent.observe.metrics.agent import LoopLagProbe
from agent.observe.observers import Observers

log = structlog.get_logger("agent")


class Agent:
    """The running agent's components; read by the debug endpoint and by tests.

    It owns the derived per-node state: when the inventory, the config or the node's labels
    change, it updates health tracking and the ownership table first and then publishes the
    new inventory, so that a consumer woken by a change always reads a consistent picture.
    """

    def __init__(
        self,
        *,
        config_state: ConfigState,
        node_name: str,
        backend: Backend,
        node: NodeFacts,
        cdi: CdiProvider,
        mechanisms: Mapping[str, Mechanism],
        labels: NodeLabelSource | StaticLabelSource,
        handover: Handover,
        observers: Observers,
        loop_lag: LoopLagProbe,
    ) -> None:
        self.config_state = config_state
        self.node_name = node_name
        self.backend = backend
        self.inventories = node.inventory
        self.health = node.health
        self.ownership = node.ownership
        self.cdi = cdi
        self._mechanisms = dict(mechanisms)
        self.labels = labels
        #: the only writer of grants: desired owners become granted once the old owner let go
        self.handover = handover
        #: utilization, orphaned allocations, the registration watchdog
        self.observers = observers
        self.loop_lag = loop_lag
        self.debug_port = 0
        #: labels read from the Node object; the config's node_labels win over them
        self.api_labels: dict[str, str] = {}

    # --- views ---------------------------------------------------------------------

    @property
    def inventory(self) -> Inventory:
        return self.inventories.current

    @property
    def mechanisms(self) -> Mapping[str, Mechanism]:
        return self._mechanisms

    def gpu_uuids(self) -> list[str]:
        return [gpu.uuid for gpu in self.inventory.gpus]

    def inventory_problems(self) -> int:
        return len(self.inventory.problems)

    @property
    def status(self) -> str:
        return "serving" if self.inventory.gpus else "no devices"

    def compute_ownership(self, loaded: LoadedConfig, inventory: Inventory | None = None) -> OwnershipTable:
        config = loaded.config
        return compute_ownership(
            inventory or self.inventory,
            config.ownership,
            node_name=self.node_name,
            node_labels=self.node_labels(config),
            version=loaded.version,
        )

    def node_labels(self, config: Config) -> dict[str, str]:
        return {**self.api_labels, **config.node_labels}

    def labels_needed(self) -> bool:
        """Whether ownership depends on labels the agent has not read yet."""
        return uses_label_rules(self.config_state.config.ownership) and not self.labels.synced.is_set()

    def labels_state(self) -> dict[str, object]:
        state: dict[str, object] = {
            "source": "api" if isinstance(self.labels, NodeLabelSource) else "config",
            "synced": self.labels.synced.is_set(),
            "last_error": self.labels.last_error,
        }
        if isinstance(self.labels, NodeLabelSource):
            state["watch"] = self.labels.debug_state()
        return state

    def backend_state(self) -> dict[str, object]:
        return {"name": self.backend.name, **self.backend.status()}

    def readiness(self) -> dict[str, Readiness]:
        """Check name -> result, for /readyz and the ``ready`` event."""
        backend_ok, backend_detail = self.backend.readiness()
        inventory = self.inventory
        detail = backend_detail or f"{len(inventory.gpus)} GPUs ({inventory.backend})"
        if inventory.problems:
            detail += f"; {len(inventory.problems)} device(s) could not be read: {inventory.problems[0]}"
        checks = {
            "inventory": Readiness(backend_ok, detail),
            "debug": Readiness(bool(self.debug_port), "" if self.debug_port else "debug endpoint not listening"),
        }
        if self.labels_needed():
            reason = self.labels.last_error or "no answer yet"
            checks["node-labels"] = Readiness(False, f"waiting for the node's labels from the API server: {reason}")
            return checks
        for name, mechanism in self._mechanisms.items():
            checks[name] = mechanism.readiness()
        ok, detail = self.cdi.last_pass_ok()
        checks["cdi"] = Readiness(ok, detail)
        checks["watchdog"] = self.observers.watchdog.readiness()
        return checks

    def simulated_control(self) -> SimulatedControl | None:
        from agent.backends.simulated import SimulatedBackend

        return self.backend if isinstance(self.backend, SimulatedBackend) else None

    def state(self) -> dict[str, Any]:
        return agent_state(self)

    def owner_counts(self) -> dict[str, int]:
        return {owner.value: n for owner, n in self.ownership.current.counts().items()}

    # --- tasks ---------------------------------------------------------------------

    async def follow_config(self) -> None:
        """Apply accepted config changes: health policy and ownership (mechanisms follow themselves)."""
        with self.config_state.changes.subscribe() as changes:
            async for loaded in changes:
                set_level(loaded.config.log_level)
                self.health.update_config(loaded.config.health)
                self.backend.update_health_config(loaded.config.health)
                self._log_plan(loaded)
                self._recompute_ownership(f"config {loaded.version}")

    def _log_plan(self, loaded: LoadedConfig) -> None:
        """Before a reload applies: what ``gpu-agent config plan`` would have said about it."""
        desired = self.compute_ownership(loaded)
        granted = self.ownership.current
        holders: dict[str, list[str]] = {}
        unknown: dict[str, str] = {}
        for mechanism in self._mechanisms.values():
            usage = mechanism.usage()
            if not usage.known:  # a move away from it waits for its answer, as the handover does
                unknown[mechanism.owner.value] = usage.reason
            for gpu, held in usage.holders.items():
                holders.setdefault(gpu, []).extend(f"{h.kind} {h.namespace}/{h.name}" for h in held)
        current = {gpu: granted.state_of(gpu) for gpu in granted.gpus()}
        for row in plan_rows(self.inventory, desired, current=current, holders=holders, unknown=unknown):
            if row.moves:
                log.info(
                    "config plan",
                    gpu=row.uuid,
                    index=row.index,
                    now=row.current,
                    new=row.desired,
                    rule=row.rule,
                    waits_for=list(row.waits_for),
                )

    async def watch_health(self) -> None:
        """Run the backend's health watch, moving it to each new inventory as it arrives.

        The new watch starts before the old one stops, so the backend's hooks (the simulated
        injection path) never see a moment without a running watch.
        """
        with self.inventories.changes.subscribe() as changes:
            watch = self._start_watch()
            try:
                while True:
                    changed = asyncio.create_task(changes.get())
                    try:
                        await asyncio.wait({watch, changed}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        changed.cancel()
                    if watch.done():
                        watch.result()  # a failure propagates; a plain return is caught by the guard
                        return
                    changes.drain()
                    old, watch = watch, self._start_watch()
                    await asyncio.sleep(0)  # let the new watch take over before the old one ends
                    old.cancel()
                    await asyncio.gather(old, return_exceptions=True)
            finally:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)

    def _start_watch(self) -> asyncio.Task[None]:
        return asyncio.create_task(
            self.backend.watch_health(self.inventory, self.health.observe), name="backend-health-watch"
        )

    async def refresh_inventory(self) -> None:
        """Re-read the backend now and then; a changed inventory reaches every consumer."""
        while True:
            await asyncio.sleep(self.config_state.config.inventory_refresh_s)
            try:
                inventory = await self.backend.load()
            except AgentError as exc:
                log.warning("inventory reload failed; keeping the last inventory", error=str(exc))
                continue
            if inventory != self.inventory:
                self.apply_inventory(inventory)

    def apply_inventory(self, inventory: Inventory) -> None:
        """Install a new inventory: health and ownership first, then the change feed."""
        before = {g.uuid for g in self.inventory.gpus}
        after = {g.uuid for g in inventory.gpus}
        log.info(
            "inventory changed",
            gpus=len(inventory.gpus),
            gone=sorted(before - after),
            new=sorted(after - before),
            driver=inventory.driver_version,
        )
        self.health.set_inventory(inventory)
        self._recompute_ownership("inventory changed", inventory)
        self.inventories.update(inventory)

    async def follow_labels(self) -> None:
        """Watch the Node's labels while the node has GPUs (a node without GPUs talks to nobody)."""
        with self.inventories.changes.subscribe() as changes:
            while not self.inventory.gpus:
                await changes.get()
        await self.labels.watch(self.on_labels)

    def on_labels(self, labels: dict[str, str]) -> None:
        """The Node's labels changed (a pool relabelled): ownership rules may now match differently."""
        self.api_labels = labels
        self._recompute_ownership("node labels changed")

    async def serve(self, name: str, mechanism: Mechanism) -> None:
        """Run one mechanism, once ownership can be trusted (labels known when rules use them)."""
        if self.labels_needed():
            log.info("waiting for the node's labels before serving", mechanism=name)
            await self.labels.synced.wait()
            self._recompute_ownership("node labels known")
        await mechanism.run()

    def _recompute_ownership(self, reason: str, inventory: Inventory | None = None) -> None:
        """Desired owners for the current config, inventory and labels, handed to the handover."""
        desired = self.compute_ownership(self.config_state.loaded, inventory)
        if dict(desired.owners) != dict(self.ownership.desired.owners):
            counts = {owner.value: n for owner, n in desired.counts().items()}
            log.info("desired ownership changed", reason=reason, desired=counts)
        self.handover.set_long_wait(self.config_state.config.ownership.handover_warning_s)
        self.handover.set_desired(desired)
