"""The device plugin as one component: a server per resource, kept registered and current.

:class:`PluginManager` is built by ``agent/runtime/app.py`` (on every node with GPUs) and run in
the agent's TaskGroup. ``run`` serves until cancelled:

* one :class:`PluginServer` per resource name that the plugin config and the inventory call
  for (:func:`plan_resources`). A change of the ``plugin`` config section or of the inventory
  (the :class:`~agent.core.inventory.current.InventoryState` feed) re-plans them through one path,
  :meth:`_apply_plan`: each server whose resource name stays is kept (still registered; its
  ListAndWatch streams get the new list), so no change but the kubelet's own ever registers a
  resource twice. Servers that go stop and remove their sockets before new ones serve and Register;
* the kubelet's ``device-plugins`` directory is watched (inotify, :mod:`agent.base.fswatch`). A batch
  that names ``kubelet.sock``, a server's socket or RESCAN wakes the servers concerned, and each
  looks at the state and does what it calls for (:mod:`agent.deviceplugin.registration`): events are
  hints, never counted, and ``kubelet.sock`` inode numbers are never compared;
* health and ownership changes make every open ListAndWatch stream send the new list at once,
  and bring the Node's counts of our resources down to what we list (:mod:`agent.deviceplugin.nodeview`:
  a GPU the plugin gives up is served until the scheduler no longer counts it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import structlog
from prometheus_client import CollectorRegistry

from agent.base.backoff import Backoff
from agent.base.feeds import Subscription
from agent.base.fswatch import RESCAN, DirectoryWatcher
from agent.core.config.current import ConfigState
from agent.core.config.loader import LoadedConfig
from agent.core.config.schema import Owner, PluginConfig
from agent.core.inventory.model import Inventory
from agent.core.mechanism import (
    NodeCounts,
    NodeStatus,
    NoNodeCounts,
    Readiness,
    RegistrationCheck,
    SchedulerView,
    Usage,
)
from agent.core.node import NodeFacts
from agent.deviceplugin.cdinames import CdiNames
from agent.deviceplugin.divergence import ReplicaCount, plugin_checks, replica_counts
from agent.deviceplugin.link import KubeletLink
from agent.deviceplugin.metrics import PluginCollector, PluginMetrics
from agent.deviceplugin.nodeview import closed_gpus, node_ceilings
from agent.deviceplugin.podresources import PodResourcesWatcher, Snapshot
from agent.deviceplugin.preferred import TopologyScorer
from agent.deviceplugin.resources import Resource, ResourcePlan, plan_resources
from agent.deviceplugin.server import (
    DEFAULT_REGISTRATION_TIMEOUTS,
    KUBELET_SOCKET,
    REGISTRATION_BACKOFF,
    PluginServer,
    RegistrationTimeouts,
)
from agent.deviceplugin.service import ResourceService
from agent.deviceplugin.usage import DeviceUsage, device_usage

log = structlog.get_logger("agent.plugin")


def _socket_present(path: Path) -> bool | str:
    """Whether ``path`` exists; a reason string when the directory cannot be looked into."""
    try:
        path.lstat()
    except FileNotFoundError:
        return False
    except OSError as exc:
        return f"{path.parent}: {exc.strerror or exc}"
    return True


class PluginManager:
    """The device plugin mechanism (:class:`agent.core.mechanism.Mechanism`)."""

    owner = Owner.DEVICE_PLUGIN

    def __init__(
        self,
        *,
        config_state: ConfigState,
        node: NodeFacts,
        cdi: CdiNames,
        plugin_dir: Path,
        registry: CollectorRegistry | None = None,
        backoff: Backoff = REGISTRATION_BACKOFF,
        timeouts: RegistrationTimeouts = DEFAULT_REGISTRATION_TIMEOUTS,
        pod_resources: PodResourcesWatcher | None = None,
        node_counts: NodeCounts | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config_state = config_state
        #: lowers the Node's counts of our resources (the scheduler's view) as GPUs leave us
        self.node_counts: NodeCounts = node_counts or NoNodeCounts()
        self._clock = clock
        #: closing GPUs let go without the Node lowered (warned once each)
        self._given_up: frozenset[str] = frozenset()
        #: who holds which device, from the kubelet (None: not asked, usage unknown); asked more
        #: often while a GPU drains away from the plugin (its handover waits for a fresh answer)
        self.pod_resources = pod_resources
        if pod_resources is not None:
            pod_resources.urgent = self._draining_away
        self._inventories = node.inventory
        #: the inventory the servers' plan was built from
        self._inventory = node.inventory.current
        self._health = node.health
        self._ownership = node.ownership
        self._cdi = cdi
        self.plugin_dir = plugin_dir
        self.kubelet_socket = self.plugin_dir / KUBELET_SOCKET
        self._metrics = PluginMetrics(registry)
        self._backoff = backoff
        self._timeouts = timeouts
        self._scorer = TopologyScorer(self._inventory)
        self._config: PluginConfig = config_state.config.plugin
        self._plan = ResourcePlan()
        self._servers: dict[str, PluginServer] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: set when the plan may be stale (plugin config or inventory changed)
        self._replan = asyncio.Event()
        self._running = False
        self._watch_mode = ""
        #: directory-watch batches handled, and the names of the last one (debug, tests)
        self.watch_batches = 0
        self.last_watch_names: frozenset[str] = frozenset()
        if registry is not None:
            registry.register(
                PluginCollector(
                    replicas=self.replica_counts,
                    pod_resources_failures=lambda: pod_resources.failures if pod_resources is not None else 0,
                )
            )

    # --- the Mechanism interface: /readyz, /debug/state, who advertises and uses what ------------

    @property
    def ready(self) -> bool:
        """The kubelet holds a ListAndWatch stream of every server (True with no servers)."""
        return self._running and all(s.registered for s in self._servers.values())

    def first_registration_settled(self) -> bool:
        """Every server has had its first Register answered (or failed to serve or register).

        The composition root waits for this (briefly) before loading the rest of the agent, so
        that the kubelet hears from the plugin first.
        """
        return self._running and all(s.registrations or s.last_error for s in self._servers.values())

    @property
    def servers(self) -> dict[str, PluginServer]:
        return dict(self._servers)

    def readiness(self) -> Readiness:
        """Registered everywhere; or serving and waiting for a kubelet that is not there yet.

        A server that cannot listen (no permission, a foreign file in the way) is never ready,
        kubelet or not: the node would advertise nothing once one comes.
        """
        if not self._running:
            return Readiness(False, "device plugin not started")
        if self.ready:
            return Readiness(True)
        repairing = [s for s in self._servers.values() if s.repairing]
        if repairing:  # a moment between the watchdog's stop and the new registration
            return Readiness(True, f"device plugin registering again: {repairing[0].last_restart_reason}")
        not_serving = [s for s in self._servers.values() if not s.serving]
        if not_serving:
            errors = [s.last_error for s in not_serving if s.last_error]
            return Readiness(False, "device plugin not serving" + (f": {errors[0]}" if errors else ""))
        present = _socket_present(self.kubelet_socket)
        if isinstance(present, str):
            return Readiness(False, f"device plugin cannot look for the kubelet: {present}")
        if not present:
            # no kubelet (yet): nothing is wrong with the agent, and it registers the moment one appears
            return Readiness(True, f"waiting for the kubelet: no {self.kubelet_socket}")
        waiting = [s for s in self._servers.values() if not s.registered]
        errors = [s.last_error for s in waiting if s.last_error]
        detail = errors[0] if errors else "the kubelet holds no ListAndWatch stream of ours"
        return Readiness(False, f"device plugin not registered: {detail}")

    def advertised_gpus(self) -> frozenset[str]:
        """Physical GPUs some server currently lists to the kubelet."""
        return frozenset(d.device.gpu_uuid for s in self._servers.values() for d in s.advertised())

    def usage(self) -> Usage:
        return self._device_usage().usage

    def _draining_away(self) -> bool:
        return any(d.source is Owner.DEVICE_PLUGIN for d in self._ownership.current.draining.values())

    def scheduler_view(self) -> SchedulerView:
        """Which closing GPUs the scheduler no longer counts on (:func:`closed_gpus`)."""
        result = closed_gpus(self._plan.resources, self._ownership.current, self.node_counts, self._clock())
        for gpu in sorted(result.given_up - self._given_up):
            log.warning(
                "the Node's counts could not be lowered in time; the GPU leaves the device plugin regardless",
                gpu=gpu,
                node_counts=self.node_counts.debug_state(),
            )
        self._given_up = result.given_up
        return result.view

    def use_node_counts(self, node_counts: NodeCounts) -> None:
        """Lower the Node's counts through ``node_counts`` from now on (phase 2 brings the API client)."""
        self.node_counts = node_counts
        self._push_ceilings()

    def _push_ceilings(self) -> None:
        """Tell the Node gate what the scheduler may count now (no I/O); not before this start's
        grants are known (lowering the Node to a list that is still being decided would send the
        scheduler's ``nvidia.com/gpu`` pods to DRA until the kubelet's next status sync)."""
        if not self._ownership.decided.is_set():
            return
        self.node_counts.lower_to(node_ceilings(self._plan.resources, self._ownership.current, self._health))

    def _device_usage(self) -> DeviceUsage:
        """Which GPUs containers hold, from the newest PodResources answer (unknown without one)."""
        watcher = self.pod_resources
        if watcher is None:
            return DeviceUsage(Usage(known=False, reason="the kubelet's PodResources API is not consulted"))
        plan = {r.name: r for r in self._plan.resources}
        return device_usage(
            watcher.latest,
            reason="" if watcher.known else watcher.last_error,
            plan=plan,
            inventory=self._inventories.current,
            own_names={*plan, self._config.resource_name},
        )

    def gpu_details(self) -> dict[str, dict[str, object]]:
        """The device plugin adds nothing per GPU to ``/debug/state``."""
        return {}

    def registration_checks(self, node: NodeStatus) -> list[RegistrationCheck]:
        """Per resource: our healthy devices against the kubelet's allocatable ones and the Node's count."""
        return plugin_checks(self._servers, self._kubelet_answer(), node)

    def replica_counts(self) -> list[ReplicaCount]:
        """Time-sliced replicas per GPU: advertised, and held by containers."""
        return replica_counts({r.name: r for r in self._plan.resources}, self._servers, self._kubelet_answer())

    def _kubelet_allocatable(self) -> dict[str, int] | None:
        answer = self._kubelet_answer()
        if answer is None or answer.allocatable is None:
            return None
        ours = {*self._servers, self._config.resource_name}
        return {name: len(ids) for name, ids in sorted(answer.allocatable.items()) if name in ours}

    def _kubelet_answer(self) -> Snapshot | None:
        """The newest PodResources answer, when the newest call succeeded (None: unknown)."""
        watcher = self.pod_resources
        return watcher.latest if watcher is not None and watcher.known else None

    def debug_state(self) -> dict[str, object]:
        present = _socket_present(self.kubelet_socket)
        return {
            "ready": self.ready,
            "readiness": self.readiness().detail,
            "plugin_dir": str(self.plugin_dir),
            "kubelet_socket_present": present if isinstance(present, bool) else None,
            "watch_mode": self._watch_mode,
            "watch_batches": self.watch_batches,
            "problems": list(self._plan.problems),
            "resources": {name: s.debug_state() for name, s in sorted(self._servers.items())},
            "replicas": [r.as_dict() for r in self.replica_counts()],
            "pod_resources": self._pod_resources_state(),
            "node_counts": self.node_counts.debug_state(),
        }

    def _pod_resources_state(self) -> dict[str, object]:
        watcher = self.pod_resources
        if watcher is None:
            return {"enabled": False}
        usage = self._device_usage()
        return {
            "socket": str(watcher.client.socket),
            "known": watcher.known,
            "last_error": watcher.last_error,
            "calls": watcher.calls,
            "failures": watcher.failures,
            "allocatable_served": watcher.client.allocatable_served,
            # what the kubelet counts as allocatable of ours (the watchdog compares it with what we list)
            "kubelet_allocatable": self._kubelet_allocatable(),
            "unadvertised_ids": list(usage.unmapped),
        }

    @property
    def inventory(self) -> Inventory:
        """The inventory the current servers were planned from."""
        return self._inventory

    # --- run --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until cancelled; sockets are removed on the way out."""
        try:
            self.plugin_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        except OSError as exc:
            # not ours to create (no kubelet here, or no permission): servers retry with backoff
            # and the directory watcher notices when the kubelet makes it and its socket
            log.warning(
                "cannot create the device-plugins directory; waiting for the kubelet",
                dir=str(self.plugin_dir),
                error=exc.strerror or str(exc),
            )
        try:
            # subscribed before the first plan, so no config or inventory change slips in between
            with (
                self._config_state.changes.subscribe() as config_changes,
                self._inventories.changes.subscribe() as inventory_changes,
            ):
                async with DirectoryWatcher(self.plugin_dir) as watcher, asyncio.TaskGroup() as tg:
                    self._watch_mode = watcher.mode
                    await self._apply_plan(tg)
                    self._running = True
                    tg.create_task(self._watch_plan(tg), name="plugin-watch-plan")
                    tg.create_task(self._watch_files(watcher), name="plugin-watch-files")
                    tg.create_task(self._watch_config(config_changes), name="plugin-watch-config")
                    tg.create_task(self._watch_inventory(inventory_changes), name="plugin-watch-inventory")
                    tg.create_task(self._watch_health(), name="plugin-watch-health")
                    tg.create_task(self._watch_ownership(), name="plugin-watch-ownership")
                    tg.create_task(self._when_decided(), name="plugin-grants-decided")
                    if self.pod_resources is not None:
                        tg.create_task(self.pod_resources.run(), name="plugin-pod-resources")
        finally:
            self._running = False
            self._servers = {}
            self._tasks = {}

    async def _watch_plan(self, tg: asyncio.TaskGroup) -> None:
        while True:
            await self._replan.wait()
            self._replan.clear()
            await self._apply_plan(tg)

    async def _apply_plan(self, tg: asyncio.TaskGroup) -> None:
        """Bring the servers in line with the current plugin config and the newest inventory.

        The one (re)build path, run at start and from the plan task only, so never twice at once.
        The server of every resource name that stays is kept, registered, and gets the new device
        list, config, inventory and scorer; only its open ListAndWatch streams notice. (Stopping
        it and registering the same resource again would race the kubelet's handling of the old
        stream's end.) Servers of resources that go stop (streams end, socket removed) before
        servers of new resources are started, so a reused socket name is never served twice.
        """
        config = self._config_state.config.plugin
        inventory = self._inventories.current
        self._config, self._inventory = config, inventory
        if self._scorer.inventory is not inventory:
            self._scorer = TopologyScorer(self._inventory)
        self._plan = plan_resources(inventory, config)
        for problem in self._plan.problems:
            log.warning("device plugin config cannot be fully honoured", problem=problem)
        wanted = {r.name: r for r in self._plan.resources}
        stopped = [name for name in self._servers if name not in wanted]
        kept = [name for name in wanted if name in self._servers]
        for name in kept:  # before any await: a kept server never restarts with a stale resource
            self._servers[name].update(wanted[name], config=config, inventory=inventory, scorer=self._scorer)
        await self._stop_servers(stopped)
        started = [name for name in wanted if name not in self._servers]
        for name in started:
            self._start_server(tg, wanted[name])
        self._push_ceilings()
        log.info("device plugin resources", resources=self._plan.names(), started=started, stopped=stopped, kept=kept)

    def _start_server(self, tg: asyncio.TaskGroup, resource: Resource) -> None:
        server = PluginServer(
            resource=resource,
            make_service=self._make_service,
            plugin_dir=self.plugin_dir,
            metrics=self._metrics,
            backoff=self._backoff,
            timeouts=self._timeouts,
        )
        self._servers[resource.name] = server
        self._tasks[resource.name] = tg.create_task(server.run(), name=f"plugin-server:{resource.name}")

    async def _stop_servers(self, names: list[str]) -> None:
        """Cancel these servers' tasks and wait until each has closed and removed its socket."""
        tasks = []
        for name in names:
            del self._servers[name]
            task = self._tasks.pop(name)
            task.cancel()
            tasks.append(task)
        if tasks:
            await asyncio.wait(tasks)

    def _make_service(self, resource: Resource, link: KubeletLink) -> ResourceService:
        return ResourceService(
            resource=resource,
            link=link,
            config=self._config,
            inventory=self._inventory,
            ownership=self._ownership,
            health=self._health,
            cdi=self._cdi,
            scorer=self._scorer,
        )

    # --- reactions --------------------------------------------------------------------------

    async def _watch_files(self, watcher: DirectoryWatcher) -> None:
        async for names in watcher:
            self.on_files_changed(names)

    def on_files_changed(self, names: set[str]) -> None:
        """A watcher batch: wake the servers it may concern. :data:`~agent.base.fswatch.RESCAN` in it
        means any name may have changed, so every server looks."""
        self.watch_batches += 1
        self.last_watch_names = frozenset(names)
        everyone = RESCAN in names or KUBELET_SOCKET in names
        for server in self._servers.values():
            if everyone or server.socket_path.name in names:
                server.wake()

    async def _watch_config(self, changes: Subscription[LoadedConfig]) -> None:
        while True:
            loaded = await changes.get()
            if loaded.config.plugin != self._config:
                log.info("device plugin config changed, re-planning resources")
                self._replan.set()

    async def _watch_inventory(self, changes: Subscription[Inventory]) -> None:
        """A new inventory (MIG reconfigured, GPU gone or added): re-plan the resources."""
        while True:
            await changes.get()
            changes.drain()
            self._replan.set()

    def _notify_all(self) -> None:
        self._push_ceilings()
        for server in self._servers.values():
            server.notify()

    async def _watch_health(self) -> None:
        with self._health.changes.subscribe() as changes:
            while True:
                await changes.get()
                changes.drain()
                self._notify_all()

    async def _when_decided(self) -> None:
        """The Node gate hears the ceilings once this start's grants are known; then idle."""
        await self._ownership.decided.wait()
        self._push_ceilings()
        await asyncio.Event().wait()

    async def _watch_ownership(self) -> None:
        with self._ownership.changes.subscribe() as changes:
            while True:
                await changes.get()
                changes.drain()
                self._notify_all()
