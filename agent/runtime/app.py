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
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog
from prometheus_client import CollectorRegistry

from agent import __version__
from agent.backends.factory import open_backend
from agent.base.logs import set_level
from agent.cdi.service import create_cdi_service
from agent.core.config.current import ConfigState
from agent.core.config.loader import LoadedConfig, load_config
from agent.core.config.node import resolve_node_name, uses_label_rules
from agent.core.health.monitor import HealthMonitor
from agent.core.inventory.current import InventoryState
from agent.core.node import NodeFacts
from agent.core.ownership.table import OwnershipState
from agent.deviceplugin.manager import PluginManager
from agent.deviceplugin.podresources import PodResourcesClient, PodResourcesWatcher
from agent.runtime.phase1 import Core, RunOptions
from agent.runtime.supervisor import supervised

if TYPE_CHECKING:
    from agent.runtime.agent import Agent

log = structlog.get_logger("agent")

#: how long shutdown may take before the agent gives up waiting on its tasks
SHUTDOWN_TIMEOUT_S = 4.0


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
            # phase 2's modules load in a worker thread: the loop keeps serving the plugin meanwhile
            await asyncio.to_thread(importlib.import_module, "agent.runtime.assemble")
            from agent.runtime.assemble import build_rest

            agent, roots = await build_rest(stack, core, options, ready)
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


async def _build_core(stack: contextlib.AsyncExitStack, loaded: LoadedConfig, node_name: str) -> Core:
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
    node = NodeFacts(inventory=inventory, health=health, ownership=OwnershipState())
    # every mechanism exists on every node: a node whose GPUs appear later (a driver container
    # that becomes ready) serves them without a restart
    plugin = PluginManager(
        config_state=config_state,
        node=node,
        cdi=cdi,
        plugin_dir=config.device_plugins_dir,
        registry=registry,
        pod_resources=PodResourcesWatcher(PodResourcesClient(config.pod_resources_socket)),
    )
    return Core(loaded, node_name, backend, node, config_state, registry, cdi, plugin)
