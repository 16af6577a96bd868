"""Phase 2 of the composition root: the API client, DRA, the observers, the agent, the debug endpoint.

``agent/runtime/app.py`` imports this module in a worker thread while the device plugin
registers: its imports are exactly what only phase 2 needs (the API client with its own HTTP
pool, DRA, observability with the debug endpoint), so loading it is loading them, off the loop.
:func:`build_agent` is also how tests assemble an :class:`~agent.runtime.agent.Agent`: one place
builds the handover, the collectors and the loop-lag probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Mapping

import structlog
from prometheus_client import CollectorRegistry

from agent.backends.backend import Backend
from agent.cdi.names import ClaimSpecDirectory
from agent.cdi.service import CdiProvider
from agent.core.config.current import ConfigState
from agent.core.config.loader import parse_host_port
from agent.core.config.watcher import ConfigWatcher
from agent.core.eventsink import EventSink
from agent.core.mechanism import Mechanism
from agent.core.node import NodeFacts
from agent.core.ownership.handover import Handover, Observed
from agent.core.ownership.handover_events import HandoverEvents
from agent.core.ownership.publish import PublishState
from agent.core.ownership.record import RecordKeeper
from agent.core.ownership.table import OwnershipTable
from agent.core.partitioning import MpsControl, NoMps
from agent.dra.mechanism import build_dra
from agent.dra.modes import ModeGate
from agent.dra.slices.noapi import NoApiPublisher
from agent.dra.slices.publisher import KubeSlicePublisher
from agent.kube.claims.model import ClaimSource
from agent.kube.claims.prefetch import ClaimPrefetch
from agent.kube.claims.source import KubeClaimSource, NoApiClaims
from agent.kube.discovery import ResourceApi
from agent.kube.labels import NodeLabelSource, StaticLabelSource, label_source
from agent.kube.nodecounts import NodeCountsGuard
from agent.kube.podclaims import NodePodClaims
from agent.kube.recorder import EventRecorder
from agent.kube.session import open_kube
from agent.observe.debug.server import DebugContext, serve_debug
from agent.observe.metrics.agent import AgentCollector, LoopLagProbe
from agent.observe.metrics.gpus import GpuCollector
from agent.observe.observers import Observers, build_observers
from agent.runtime.agent import Agent
from agent.runtime.phase1 import Core, RunOptions

log = structlog.get_logger("agent")


async def build_rest(
    stack: contextlib.AsyncExitStack, core: Core, options: RunOptions, ready: asyncio.Event
) -> tuple[Agent, dict[str, Callable[[], Awaitable[None]]]]:
    """Phase 2: API client, DRA, observers, the agent and its debug endpoint; the root tasks."""
    config, node_name, registry = core.loaded.config, core.node_name, core.registry
    kube = await stack.enter_async_context(open_kube(config, registry=registry))
    labels = label_source(client=kube, node_name=node_name, static_labels={})
    events: EventRecorder | None = None
    node_counts: NodeCountsGuard | None = None
    publisher: KubeSlicePublisher | NoApiPublisher = NoApiPublisher()
    claims: ClaimSource = NoApiClaims()
    mig, mps = core.backend.mig, core.backend.mps
    publish = PublishState()
    # each GPU's publish shape: one decision the slices, claim preparation and health all read
    gate = ModeGate(inventory=core.node.inventory, publish=publish, mps_unavailable=mps_reason(mps))
    pods: NodePodClaims | None = None
    prefetch: ClaimPrefetch | None = None
    if kube is not None:
        resources = ResourceApi(kube)
        publisher = KubeSlicePublisher(
            client=kube,
            node_name=node_name,
            driver_name=config.dra.driver_name,
            node=core.node,
            registry=registry,
            resource_api=resources,
            gate=gate,
        )
        claims = KubeClaimSource(client=kube, resource_api=resources)
        prefetch = ClaimPrefetch(claims)
        events = EventRecorder(client=kube, node_name=node_name, registry=registry)
        node_counts = NodeCountsGuard(kube, node_name=node_name)
        pods = NodePodClaims(kube, node_name=node_name)
        core.plugin.use_node_counts(node_counts)
    # loads the DRA checkpoint and tells CDI which claim specs to keep: before CDI reconciles
    dra = await build_dra(
        config,
        claims=prefetch or claims,
        publisher=publisher,
        node=core.node,
        cdi=core.cdi,
        registry=registry,
        node_name=node_name,
        gate=gate,
        mig=mig,
        mps=mps,
        pods=pods,
    )
    mechanisms: dict[str, Mechanism] = {"device-plugin": core.plugin, "dra": dra}
    observers = build_observers(
        config=core.config_state,
        backend=core.backend,
        inventory=core.node.inventory,
        mechanisms=mechanisms,
        registry=registry,
        kube=kube,
        node_name=node_name,
        claims=claims,
        pod_arrivals=prefetch,
        claim_specs=ClaimSpecDirectory(config.paths.cdi_root, config.cdi.claim_kind) if config.cdi.enabled else None,
        events=events,
        node=labels if isinstance(labels, NodeLabelSource) else None,
    )
    agent = build_agent(
        config_state=core.config_state,
        node_name=node_name,
        backend=core.backend,
        node=core.node,
        cdi=core.cdi,
        mechanisms=mechanisms,
        registry=registry,
        labels=labels,
        events=events,
        observers=observers,
        publish=publish,
        record=core.record,
        resume=core.seed,
    )
    dra.driver.set_inventory_reload(agent.reload_inventory)
    agent.handover.set_desired(agent.compute_ownership(core.loaded))
    publish.update(agent.compute_publish_modes(core.loaded))
    log.info(
        "ownership computed",
        node_rule=core.node.ownership.current.node_rule,
        counts=agent.owner_counts(),
        draining=core.node.ownership.current.drain_count(),
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
        "ready": lambda: wait_ready(agent, ready),
        **observers.roots(),
    }
    for name, mechanism in mechanisms.items():
        roots[name] = functools.partial(agent.serve, name, mechanism)
    if events is not None:
        roots["kube-events"] = events.run
    if node_counts is not None:
        roots["node-counts"] = node_counts.run
    if prefetch is not None:
        prefetch.skip_prepared(dra.driver.prepared.named)
        roots["claim-prefetch"] = prefetch.run
    if options.config_path is not None:
        watcher = ConfigWatcher(path=options.config_path, overrides=options.overrides, state=core.config_state)
        roots["config-watch"] = watcher.run
    return agent, roots


def build_agent(
    *,
    config_state: ConfigState,
    node_name: str,
    backend: Backend,
    node: NodeFacts,
    cdi: CdiProvider,
    mechanisms: Mapping[str, Mechanism],
    registry: CollectorRegistry,
    labels: NodeLabelSource | StaticLabelSource | None = None,
    events: EventSink | None = None,
    observers: Observers | None = None,
    publish: PublishState | None = None,
    record: RecordKeeper | None = None,
    resume: OwnershipTable | None = None,
) -> Agent:
    """The agent with its handover, observers, loop-lag probe and scrape-time collectors.

    ``record`` keeps the durable record of the device plugin's grants, ``resume`` the grants
    phase 1 made from it (see :mod:`agent.core.ownership.record`)."""
    handover = Handover(
        ownership=node.ownership,
        observe={mechanism.owner: functools.partial(observe, mechanism) for mechanism in mechanisms.values()},
        listener=HandoverEvents(events=events, registry=registry),
        long_wait_s=config_state.config.ownership.handover_warning_s,
        record=record,
        resume=resume,
    )
    # without API access unless given: utilization, orphans and the watchdog on what needs none
    observers = observers or build_observers(
        config=config_state, backend=backend, inventory=node.inventory, mechanisms=mechanisms, registry=registry
    )
    loop_lag = LoopLagProbe()
    agent = Agent(
        config_state=config_state,
        node_name=node_name,
        backend=backend,
        node=node,
        cdi=cdi,
        mechanisms=mechanisms,
        labels=labels or StaticLabelSource({}),
        handover=handover,
        observers=observers,
        loop_lag=loop_lag,
        publish=publish,
    )
    registry.register(
        AgentCollector(
            devices=agent, health=node.health, ownership=node.ownership, config=config_state, loop_lag=loop_lag
        )
    )
    registry.register(
        GpuCollector(
            node=node,
            mechanisms=mechanisms,
            utilization=observers.utilization,
            config=config_state,
            pod_uid=observers.orphans.pod_uid,
            claim_pods=observers.orphans.claim_pods,
        )
    )
    return agent


def mps_reason(mps: MpsControl) -> str:
    """Why shares cannot run under MPS on this node ("" when they can)."""
    return mps.reason if isinstance(mps, NoMps) else ""


def observe(mechanism: Mechanism) -> Observed:
    """What the handover sees of one mechanism: who uses which GPU, what it advertises, and which
    GPUs it still serves that the scheduler no longer counts on."""
    view = mechanism.scheduler_view()
    return Observed(mechanism.usage(), mechanism.advertised_gpus(), closed=view.closed, closing_note=view.note)


async def wait_ready(agent: Agent, ready: asyncio.Event) -> None:
    """Set ``ready`` once every readiness check passes; then idle (a root task may not return)."""
    # readiness is a view computed from several components; poll it briefly until it holds
    while not all(check.ok for check in agent.readiness().values()):  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    log.info("agent ready", status=agent.status, gpus=len(agent.inventory.gpus), debug_port=agent.debug_port)
    ready.set()
    await asyncio.Event().wait()
