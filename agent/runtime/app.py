"""The composition root: builds every component once and runs them as tasks of one loop.

Start-up, in two phases (undone in reverse by the exit stack):

1. config -> backend + inventory -> health monitor -> CDI service -> the first grants -> the
   device plugin, which starts serving and registering at once when ownership does not wait for
   node labels. The first grants come from the durable record of the device plugin's grants
   (:mod:`agent.core.ownership.record`): a GPU it lists that the config still gives the device
   plugin is granted at once, so the first ListAndWatch after a restart carries it. Every other
   GPU waits for the handover, and the first ListAndWatch answer waits (bounded) for its first
   decision rather than tell the kubelet "no GPUs";
2. meanwhile the modules only the rest needs (the API client, DRA, observability with the debug
   endpoint) load in a worker thread; then the API client, DRA (its checkpoint loaded before CDI reconciles),
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
from agent.core.inventory.model import Inventory
from agent.core.node import NodeFacts
from agent.core.ownership.handover import covers_device_plugin, seed_grants
from agent.core.ownership.record import GrantRecord, RecordKeeper
from agent.core.ownership.table import OwnershipState, OwnershipTable, compute_ownership
from agent.deviceplugin.kubeletcheckpoint import CHECKPOINT, listed_gpus
from agent.deviceplugin.manager import PluginManager
from agent.deviceplugin.podresources import PodResourcesClient, PodResourcesWatcher
from agent.deviceplugin.resources import plan_resources
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
    record, seed, ownership = await _first_grants(loaded, node_name, first)
    node = NodeFacts(inventory=inventory, health=health, ownership=ownership)
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
    return Core(loaded, node_name, backend, node, config_state, registry, cdi, plugin, record, seed)


async def _first_grants(
    loaded: LoadedConfig, node_name: str, inventory: Inventory
) -> tuple[RecordKeeper, OwnershipTable | None, OwnershipState]:
    """The durable record, and the grants it allows before anyone was asked (none when ownership
    rules match on node labels: those are not known yet)."""
    config = loaded.config
    record = GrantRecord(config.state_dir)
    on_disk = await asyncio.to_thread(record.load)
    keeper = RecordKeeper(record, on_disk=on_disk, all_gpus=(g.uuid for g in inventory.gpus))
    await keeper.forget_unreadable()
    if uses_label_rules(config.ownership) or not on_disk:
        return keeper, None, OwnershipState()
    # the kubelet's own checkpoint must show the plugin listed them last, too (a second witness)
    plan = {r.name: r for r in plan_resources(inventory, config.plugin).resources}
    kubelet = await asyncio.to_thread(
        listed_gpus,
        config.device_plugins_dir / CHECKPOINT,
        plan=plan,
        inventory=inventory,
        own_names={*plan, config.plugin.resource_name},
    )
    desired = compute_ownership(
        inventory, config.ownership, node_name=node_name, node_labels=config.node_labels, version=loaded.version
    )
    seed = seed_grants(desired, on_disk & kubelet)
    complete = covers_device_plugin(seed, desired)
    log.info(
        "first grants from the record",
        recorded=len(on_disk),
        kubelet_listed=len(kubelet),
        device_plugin=len(seed.gpus()),
        complete=complete,
    )
    return keeper, seed, OwnershipState(seed, decided=complete)
