"""The composition root: builds every component once and runs them as tasks of one loop.

Startup order (undone in reverse by the exit stack):
  config -> backend + inventory -> health monitor -> ownership table -> CDI service
  -> mechanisms (built, not yet serving) -> debug endpoint -> root tasks.

The debug endpoint listens before anything that talks to the API server or the kubelet, so
liveness and readiness answer at once whatever those peers do. Among the root tasks, the
mechanisms (device plugin; DRA) start serving only once the node's labels are known when the
ownership rules match on labels: advertising a GPU under the wrong owner and then taking it
back would be worse than advertising a moment later.

``run_agent`` takes ``stop`` and ``ready`` events so that the CLI and the tests start and
stop the agent the same way. A root task that fails, or returns when it should run
forever, stops the whole agent with :class:`AgentCrashed`; the DaemonSet restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from agent import __version__
from agent.cdi.service import CdiProvider, create_cdi_service
from agent.config.loader import LoadedConfig, load_config, parse_host_port
from agent.config.plan import plan_rows
from agent.config.schema import Config, OwnershipConfig
from agent.config.state import ConfigState
from agent.config.watcher import ConfigWatcher
from agent.debug.gpu_metrics import GpuCollector
from agent.debug.metrics import AgentCollector, LoopLagProbe
from agent.debug.server import DebugContext, SimulatedControl, serve_debug
from agent.debug.state import agent_state
from agent.dra.claim import ClaimSource
from agent.dra.claim_source import KubeClaimSource
from agent.dra.mechanism import build_dra
from agent.dra.noapi import NoApiClaims, NoApiPublisher
from agent.dra.publisher import SlicePublisher
from agent.errors import AgentError
from agent.handover import Handover, Observed
from agent.handover_events import EventSink, HandoverEvents
from agent.health.monitor import HealthMonitor
from agent.inventory.backend import Backend
from agent.inventory.factory import open_backend
from agent.inventory.model import Inventory
from agent.inventory.state import InventoryState
from agent.kube.discovery import ResourceApi
from agent.kube.labels import NodeLabelSource, StaticLabelSource, label_source
from agent.kube.recorder import EventRecorder
from agent.kube.session import open_kube
from agent.logs import set_level
from agent.mechanism import Mechanism, Readiness
from agent.observability import Observers, build_observers
from agent.ownership import OwnershipState, OwnershipTable, compute_ownership
from agent.plugin.manager import PluginManager
from agent.plugin.podresources import PodResourcesClient, PodResourcesWatcher

log = structlog.get_logger("agent")

#: how long shutdown may take before the agent gives up waiting on its tasks
SHUTDOWN_TIMEOUT_S = 4.0


class AgentCrashed(AgentError):
    """A root task failed or ended; the agent stopped."""


@dataclass(frozen=True, slots=True)
class RunOptions:
    config_path: Path | None = None
    #: dotted config paths set by flags and GPU_AGENT_* variables; they win over the file
    overrides: Mapping[str, Any] = field(default_factory=dict)


def resolve_node_name(config: Config) -> str:
    return config.node_name or os.environ.get("NODE_NAME", "") or socket.gethostname()


def uses_label_rules(config: OwnershipConfig) -> bool:
    """Whether any ownership rule matches nodes by label (then the Node's labels matter)."""
    return any(rule.match.labels for rule in config.nodes)


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
        inventory: InventoryState,
        health: HealthMonitor,
        ownership: OwnershipState,
        cdi: CdiProvider,
        mechanisms: Mapping[str, Mechanism],
        registry: CollectorRegistry,
        labels: NodeLabelSource | StaticLabelSource | None = None,
        events: EventSink | None = None,
        observers: Observers | None = None,
    ) -> None:
        self.config_state = config_state
        self.node_name = node_name
        self.backend = backend
        self.inventories = inventory
        self.health = health
        self.ownership = ownership
        self.cdi = cdi
        self._mechanisms = dict(mechanisms)
        self.registry = registry
        self.labels = labels or StaticLabelSource({})
        self.loop_lag = LoopLagProbe()
        self.debug_port = 0
        #: labels read from the Node object; the config's node_labels win over them
        self.api_labels: dict[str, str] = {}
        #: the only writer of grants: desired owners become granted once the old owner let go
        self.handover = Handover(
            ownership=ownership,
            observe={
                mechanism.owner: functools.partial(_observe, mechanism) for mechanism in self._mechanisms.values()
            },
            listener=HandoverEvents(events=events, registry=registry),
            long_wait_s=config_state.config.ownership.handover_warning_s,
        )
        registry.register(
            AgentCollector(
                devices=self, health=health, ownership=ownership, config=config_state, loop_lag=self.loop_lag
            )
        )
        #: utilization, orphaned allocations, the registration watchdog (without API access unless given)
        self.observers = observers or build_observers(
            config=config_state, backend=backend, inventory=inventory, mechanisms=self._mechanisms, registry=registry
        )
        registry.register(
            GpuCollector(
                inventory=inventory,
                health=health,
                ownership=ownership,
                mechanisms=self._mechanisms,
                utilization=self.observers.utilization,
                config=config_state,
                pod_uid=self.observers.orphans.pod_uid,
                claim_pods=self.observers.orphans.claim_pods,
            )
        )

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
        return {
            "source": "api" if isinstance(self.labels, NodeLabelSource) else "config",
            "synced": self.labels.synced.is_set(),
            "last_error": self.labels.last_error,
        }

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
        from agent.inventory.simulated import SimulatedBackend

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
        for mechanism in self._mechanisms.values():
            for gpu, held in mechanism.usage().holders.items():
                holders.setdefault(gpu, []).extend(f"{h.kind} {h.namespace}/{h.name}" for h in held)
        current = {gpu: granted.state_of(gpu) for gpu in granted.gpus()}
        for row in plan_rows(self.inventory, desired, current=current, holders=holders):
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


def _observe(mechanism: Mechanism) -> Observed:
    return Observed(mechanism.usage(), mechanism.advertised_gpus())


async def _guard(name: str, work: Callable[[], Awaitable[None]]) -> None:
    """Run a root task; a failure or an unexpected return becomes AgentCrashed."""
    try:
        await work()
    except asyncio.CancelledError:
        raise
    except AgentError as exc:
        log.error("task failed", task=name, error=str(exc))
        raise AgentCrashed(f"{name} failed: {exc}") from exc
    except Exception as exc:
        log.exception("task crashed", task=name)
        raise AgentCrashed(f"{name} crashed: {type(exc).__name__}: {exc}") from exc
    log.error("task ended unexpectedly", task=name)
    raise AgentCrashed(f"{name} ended unexpectedly")


async def _wait_ready(agent: Agent, ready: asyncio.Event) -> None:
    """Set ``ready`` once every readiness check passes; then idle (a root task may not return)."""
    # readiness is a view computed from several components; poll it briefly until it holds
    while not all(check.ok for check in agent.readiness().values()):  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    log.info("agent ready", status=agent.status, gpus=len(agent.inventory.gpus), debug_port=agent.debug_port)
    ready.set()
    await asyncio.Event().wait()


async def run_agent(
    options: RunOptions,
    *,
    stop: asyncio.Event,
    ready: asyncio.Event | None = None,
    on_agent: Callable[[Agent], None] | None = None,
) -> None:
    """Run until ``stop`` is set. Raises AgentError subclasses with one-line messages."""
    ready = ready or asyncio.Event()
    loaded = load_config(options.config_path, options.overrides)
    config = loaded.config
    set_level(config.log_level)  # the file's level; a --log-level flag is already in ``config``
    node_name = resolve_node_name(config)
    log.info("starting", version=__version__, node=node_name, config=loaded.source, config_version=loaded.version)

    async with contextlib.AsyncExitStack() as stack:
        backend = await open_backend(config, node_name=node_name)
        stack.push_async_callback(backend.close)
        first = await backend.load()
        log.info("inventory loaded", backend=first.backend, gpus=len(first.gpus), driver=first.driver_version)

        inventory = InventoryState(first)
        config_state = ConfigState(loaded)
        health = HealthMonitor(config=config.health)
        health.set_inventory(first)
        registry = CollectorRegistry(auto_describe=True)
        cdi = create_cdi_service(config, inventory=inventory, registry=registry)
        ownership = OwnershipState()
        # every mechanism exists on every node: a node whose GPUs appear later (a driver
        # container that becomes ready) serves them without a restart
        plugin = PluginManager(
            config_state=config_state,
            inventory=inventory,
            health=health,
            ownership=ownership,
            cdi=cdi,
            plugin_dir=config.device_plugins_dir,
            registry=registry,
            pod_resources=PodResourcesWatcher(PodResourcesClient(config.pod_resources_socket)),
        )
        kube = await stack.enter_async_context(open_kube(config, registry=registry))
        labels = label_source(client=kube, node_name=node_name, static_labels={})
        events: EventRecorder | None = None
        publisher: SlicePublisher | NoApiPublisher = NoApiPublisher()
        claims: ClaimSource = NoApiClaims()
        if kube is not None:
            resources = ResourceApi(kube)
            publisher = SlicePublisher(
                client=kube,
                node_name=node_name,
                driver_name=config.dra.driver_name,
                inventory=inventory,
                ownership=ownership,
                health=health,
                registry=registry,
                resource_api=resources,
            )
            claims = KubeClaimSource(client=kube, resource_api=resources)
            events = EventRecorder(client=kube, node_name=node_name, registry=registry)
        # loads the DRA checkpoint and tells CDI which claim specs to keep: before CDI reconciles
        dra = await build_dra(
            config,
            claims=claims,
            publisher=publisher,
            inventory=inventory,
            ownership=ownership,
            health=health,
            cdi=cdi,
            registry=registry,
            node_name=node_name,
        )
        mechanisms: dict[str, Mechanism] = {"device-plugin": plugin, "dra": dra}
        observers = build_observers(
            config=config_state,
            backend=backend,
            inventory=inventory,
            mechanisms=mechanisms,
            registry=registry,
            kube=kube,
            node_name=node_name,
            claims=claims,
            events=events,
        )
        agent = Agent(
            config_state=config_state,
            node_name=node_name,
            backend=backend,
            inventory=inventory,
            health=health,
            ownership=ownership,
            cdi=cdi,
            mechanisms=mechanisms,
            registry=registry,
            labels=labels,
            events=events,
            observers=observers,
        )
        agent.handover.set_desired(agent.compute_ownership(loaded))
        log.info(
            "ownership computed",
            node_rule=ownership.current.node_rule,
            counts=agent.owner_counts(),
            draining=ownership.current.drain_count(),
        )

        host, port = parse_host_port(config.debug_addr, "debug_addr")
        context = DebugContext(
            state=agent.state,
            readiness=agent.readiness,
            status=lambda: agent.status,
            registry=registry,
            simulated=agent.simulated_control(),
        )
        agent.debug_port = await stack.enter_async_context(serve_debug(context, host, port))
        if on_agent is not None:
            on_agent(agent)

        roots: dict[str, Callable[[], Awaitable[None]]] = {
            "health-watch": agent.watch_health,
            "config-follow": agent.follow_config,
            "loop-lag": agent.loop_lag.run,
            "inventory-refresh": agent.refresh_inventory,
            "cdi-reconcile": cdi.run,
            "node-labels": agent.follow_labels,
            "handover": agent.handover.run,
            "ready": lambda: _wait_ready(agent, ready),
            **observers.roots(),
        }
        for name, mechanism in mechanisms.items():
            roots[name] = functools.partial(agent.serve, name, mechanism)
        if events is not None:
            roots["kube-events"] = events.run
        if options.config_path is not None:
            watcher = ConfigWatcher(path=options.config_path, overrides=options.overrides, state=config_state)
            roots["config-watch"] = watcher.run
        await _supervise(roots, stop)
    log.info("stopped")


async def _supervise(roots: Mapping[str, Callable[[], Awaitable[None]]], stop: asyncio.Event) -> None:
    tasks: list[asyncio.Task[None]] = []
    try:
        async with asyncio.TaskGroup() as group:
            for name, work in roots.items():
                tasks.append(group.create_task(_guard(name, work), name=name))
            await stop.wait()
            log.info("stopping")
            for task in tasks:
                task.cancel()
    except* AgentCrashed as crashed:
        first = crashed.exceptions[0]
        raise AgentCrashed(str(first)) from first
