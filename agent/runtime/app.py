"""The composition root: builds every component once and runs them as tasks of one loop.

Start-up, in two phases (undone in reverse by the exit stack):

1. config -> backend + inventory -> health monitor -> CDI service -> the device plugin, which
   starts serving and registering at once when ownership does not wait for node labels. It
   advertises nothing until the handover grants it GPUs, so registering early is safe, and the
   kubelet sees the plugin before the rest of the agent has even been imported;
2. meanwhile the modules only the rest needs (aiohttp, the API client, DRA, observability) load
   in a worker thread; then the API client, DRA (its checkpoint loaded before CDI reconciles),
   the observers, the handover's first grants and the debug endpoint, then every other root
   task. The debug endpoint listens before anything talks to the API server, so liveness and
   readiness answer at once whatever that peer does. When ownership rules match on labels, the
   mechanisms start serving only once the labels are known: advertising a GPU under the wrong
   owner and then taking it back would be worse than advertising a moment later.

``run_agent`` takes ``stop`` and ``ready`` events so that the CLI and the tests start and
stop the agent the same way. A root task that fails, or returns when it should run
forever, stops the whole agent with :class:`AgentCrashed`; the DaemonSet restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import CollectorRegistry

from agent import __version__
from agent.backends.backend import Backend
from agent.backends.factory import open_backend
from agent.base.errors import AgentError
from agent.base.logs import set_level
from agent.cdi.service import CdiProvider, create_cdi_service
from agent.core.config.current import ConfigState
from agent.core.config.loader import LoadedConfig, load_config, parse_host_port
from agent.core.config.node import resolve_node_name, uses_label_rules
from agent.core.health.monitor import HealthMonitor
from agent.core.inventory.current import InventoryState
from agent.core.ownership.table import OwnershipState
from agent.deviceplugin.manager import PluginManager
from agent.deviceplugin.podresources import PodResourcesClient, PodResourcesWatcher

if TYPE_CHECKING:
    from agent.runtime.agent import Agent

log = structlog.get_logger("agent")

#: how long shutdown may take before the agent gives up waiting on its tasks
SHUTDOWN_TIMEOUT_S = 4.0


#: what only phase 2 needs: imported in a worker thread while the device plugin registers
LATE_MODULES = (
    "agent.runtime.agent",
    "agent.observe.debug.server",
    "agent.kube.session",
    "agent.kube.labels",
    "agent.kube.discovery",
    "agent.kube.recorder",
    "agent.dra.mechanism",
    "agent.dra.slices.publisher",
    "agent.kube.claims.source",
    "agent.dra.slices.noapi",
    "agent.observe.observers",
    "agent.core.config.watcher",
)


class AgentCrashed(AgentError):
    """A root task failed or ended; the agent stopped."""


@dataclass(frozen=True, slots=True)
class RunOptions:
    config_path: Path | None = None
    #: dotted config paths set by flags and GPU_AGENT_* variables; they win over the file
    overrides: Mapping[str, Any] = field(default_factory=dict)


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


def _import_late() -> None:
    for name in LATE_MODULES:
        importlib.import_module(name)


@dataclass(slots=True)
class _Core:
    """What phase 1 builds: everything the device plugin needs."""

    loaded: LoadedConfig
    node_name: str
    backend: Backend
    inventory: InventoryState
    config_state: ConfigState
    health: HealthMonitor
    registry: CollectorRegistry
    cdi: CdiProvider
    ownership: OwnershipState
    plugin: PluginManager


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
        core = await _build_core(stack, loaded, node_name)
        async with supervised() as supervisor:
            early = not uses_label_rules(config.ownership)
            if early:
                supervisor.start("device-plugin", core.plugin.run)
                await _first_registration(core.plugin)
            # the rest loads in a worker thread: the loop keeps serving the plugin meanwhile
            await asyncio.to_thread(_import_late)
            agent, roots = await _build_rest(stack, core, options, ready)
            if on_agent is not None:
                on_agent(agent)
            for name, work in roots.items():
                if name != "device-plugin" or not early:
                    supervisor.start(name, work)
            await stop.wait()
            log.info("stopping")
    log.info("stopped")


#: how long start-up waits for the device plugin's first Register before loading the rest
FIRST_REGISTRATION_WAIT_S = 0.3


async def _first_registration(plugin: PluginManager) -> None:
    """Give the device plugin's first Register the loop to itself, for a moment (the probes wait)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(FIRST_REGISTRATION_WAIT_S):
            while not plugin.first_registration_settled():  # noqa: ASYNC110 - a view of several servers
                await asyncio.sleep(0.005)


async def _build_core(stack: contextlib.AsyncExitStack, loaded: LoadedConfig, node_name: str) -> _Core:
    """Phase 1: backend, inventory, health, CDI and the device plugin (built, not started)."""
    config = loaded.config
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
    # every mechanism exists on every node: a node whose GPUs appear later (a driver container
    # that becomes ready) serves them without a restart
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
    return _Core(loaded, node_name, backend, inventory, config_state, health, registry, cdi, ownership, plugin)


async def _build_rest(
    stack: contextlib.AsyncExitStack, core: _Core, options: RunOptions, ready: asyncio.Event
) -> tuple[Agent, dict[str, Callable[[], Awaitable[None]]]]:
    """Phase 2: API client, DRA, observers, the agent and its debug endpoint; the root tasks."""
    from agent.core.config.watcher import ConfigWatcher
    from agent.core.mechanism import Mechanism
    from agent.dra.mechanism import build_dra
    from agent.dra.slices.noapi import NoApiPublisher
    from agent.dra.slices.publisher import SlicePublisher
    from agent.kube.claims.model import ClaimSource
    from agent.kube.claims.source import KubeClaimSource, NoApiClaims
    from agent.kube.discovery import ResourceApi
    from agent.kube.labels import label_source
    from agent.kube.recorder import EventRecorder
    from agent.kube.session import open_kube
    from agent.observe.debug.server import DebugContext, serve_debug
    from agent.observe.observers import build_observers
    from agent.runtime.agent import Agent

    config, node_name, registry = core.loaded.config, core.node_name, core.registry
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
            inventory=core.inventory,
            ownership=core.ownership,
            health=core.health,
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
        inventory=core.inventory,
        ownership=core.ownership,
        health=core.health,
        cdi=core.cdi,
        registry=registry,
        node_name=node_name,
    )
    mechanisms: dict[str, Mechanism] = {"device-plugin": core.plugin, "dra": dra}
    observers = build_observers(
        config=core.config_state,
        backend=core.backend,
        inventory=core.inventory,
        mechanisms=mechanisms,
        registry=registry,
        kube=kube,
        node_name=node_name,
        claims=claims,
        events=events,
    )
    agent = Agent(
        config_state=core.config_state,
        node_name=node_name,
        backend=core.backend,
        inventory=core.inventory,
        health=core.health,
        ownership=core.ownership,
        cdi=core.cdi,
        mechanisms=mechanisms,
        registry=registry,
        labels=labels,
        events=events,
        observers=observers,
    )
    agent.handover.set_desired(agent.compute_ownership(core.loaded))
    log.info(
        "ownership computed",
        node_rule=core.ownership.current.node_rule,
        counts=agent.owner_counts(),
        draining=core.ownership.current.drain_count(),
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

    roots: dict[str, Callable[[], Awaitable[None]]] = {
        "health-watch": agent.watch_health,
        "config-follow": agent.follow_config,
        "loop-lag": agent.loop_lag.run,
        "inventory-refresh": agent.refresh_inventory,
        "cdi-reconcile": core.cdi.run,
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
        watcher = ConfigWatcher(path=options.config_path, overrides=options.overrides, state=core.config_state)
        roots["config-watch"] = watcher.run
    return agent, roots


class Supervisor:
    """Root tasks of one TaskGroup, each behind :func:`_guard`; started one by one."""

    def __init__(self, group: asyncio.TaskGroup) -> None:
        self._group = group
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, name: str, work: Callable[[], Awaitable[None]]) -> None:
        self.tasks.append(self._group.create_task(_guard(name, work), name=name))


@contextlib.asynccontextmanager
async def supervised() -> AsyncIterator[Supervisor]:
    """Run root tasks until the body returns (then cancel them) or one of them fails.

    A failing root task cancels the others and the body, and comes out as one
    :class:`AgentCrashed`; an AgentError raised by the body itself (a start-up failure while
    the first roots already run) comes out as itself, one line.
    """
    try:
        async with asyncio.TaskGroup() as group:
            supervisor = Supervisor(group)
            yield supervisor
            for task in supervisor.tasks:
                task.cancel()
    except* AgentCrashed as crashed:
        first = crashed.exceptions[0]
        raise AgentCrashed(str(first)) from first
    except* AgentError as failed:
        raise failed.exceptions[0] from None


async def _supervise(roots: Mapping[str, Callable[[], Awaitable[None]]], stop: asyncio.Event) -> None:
    """Run ``roots`` until ``stop`` is set (or one of them fails)."""
    async with supervised() as supervisor:
        for name, work in roots.items():
            supervisor.start(name, work)
        await stop.wait()
        log.info("stopping")
