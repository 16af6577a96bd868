"""The ownership invariant, under random sequences of everything that can happen on a node.

At no instant does a GPU appear both in the device plugin's ListAndWatch and in this node's
ResourceSlices, no GPU is held through both mechanisms at once, and every drain completes once
its users are gone.

The machine drives the real pieces that decide — :class:`~agent.core.ownership.handover.Handover`, the plugin's
``advertised``/``resolve_ids`` (what ListAndWatch lists and Allocate accepts), the PodResources
mapping, and the real DRA driver with its checkpoint and CDI specs on disk — through the
kubelet's and the scheduler's moves, with their real constraints:

* the kubelet allocates only devices ListAndWatch lists, and PodResources shows an allocation
  a moment after Allocate answered (well inside the handover's settle window);
* the scheduler allocates only devices of slices the API has; a slice write is attempted, then
  succeeds (or not yet); ``published_gpus`` covers attempted and written;
* PodResources may be down; the agent may restart at any point (grants derived afresh, the DRA
  checkpoint restored, the publisher not trusting slices until it has listed them) — a restart
  takes longer than the kubelet takes to record an allocation it already had the answer for.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agent.backends.simulated import SimulatedBackend
from agent.cdi.service import create_cdi_service
from agent.core.config.schema import HealthConfig, NodeMatch, NodeRule, Owner, OwnershipConfig, PluginConfig
from agent.core.health.model import Signal, SignalKind
from agent.core.health.monitor import HealthMonitor
from agent.core.inventory.current import InventoryState
from agent.core.inventory.model import Inventory
from agent.core.mechanism import Readiness, Usage
from agent.core.ownership.handover import SETTLE_S, Handover, Observed
from agent.core.ownership.table import OwnershipState, compute_ownership
from agent.deviceplugin.allocate import resolve_ids
from agent.deviceplugin.errors import AllocationError
from agent.deviceplugin.podresources import ContainerDevices, Snapshot
from agent.deviceplugin.resources import advertised, plan_resources
from agent.deviceplugin.usage import device_usage
from agent.dra.devices import dra_devices
from agent.dra.mechanism import DraMechanism, build_dra
from agent.kube.claims.model import ClaimRef
from tests.dra_fakes import BOOT, NODE, FakeClaimSource, make_config, result

DP, DRA, NONE = Owner.DEVICE_PLUGIN, Owner.DRA, Owner.NONE
N_GPUS = 3
OWNERS = st.sampled_from([DP, DRA, NONE])
GPU = st.integers(min_value=0, max_value=N_GPUS - 1)
NAME = st.sampled_from([f"w{i}" for i in range(4)])


class ModelPublisher:
    """The ResourceSlice publisher as the scheduler sees it: attempted, written, listed."""

    def __init__(self, inventory: Inventory, written: frozenset[str] = frozenset()) -> None:
        self._all = frozenset(g.uuid for g in inventory.gpus)
        self.written = written  # what the API has
        self.attempting: frozenset[str] = frozenset()
        self.listed = False  # a fresh publisher trusts nothing until it has listed

    def published_gpus(self) -> frozenset[str]:
        if not self.listed:
            return self._all
        return self.written | self.attempting

    async def run(self) -> None:
        await asyncio.Event().wait()

    def kick(self) -> None:
        return None

    def readiness(self) -> Readiness:
        return Readiness(True)

    def debug_state(self) -> dict[str, object]:
        return {}


class Node(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.root = Path(tempfile.mkdtemp(prefix="hi-", dir="/tmp"))
        (self.root / "driver").mkdir()
        self.config = make_config(self.root)
        full = self.run(SimulatedBackend(preset="h100-8x-nvlink", node_name=NODE, health=HealthConfig()).load())
        self.inventory = replace(full, gpus=full.gpus[:N_GPUS])
        self.gpus = [g.uuid for g in self.inventory.gpus]
        self.devices = {d.gpu_uuid: d.name for d in dra_devices(self.inventory)}
        self.resource = plan_resources(self.inventory, PluginConfig()).resources[0]
        self.inventories = InventoryState(self.inventory)
        self.health = HealthMonitor(config=HealthConfig(recovery_quiet_s=0.0))
        self.health.set_inventory(self.inventory)
        self.clock = 100.0
        self.want: dict[int, Owner] = dict.fromkeys(range(N_GPUS), DP)
        # the kubelet: pods holding device-plugin GPUs, allocations not yet in PodResources
        self.pods: dict[str, str] = {}
        self.pending: list[tuple[str, str, float]] = []
        self.podresources_up = True
        self.snapshot: Snapshot | None = None
        # the API server: claims the scheduler allocated, and prepared ones
        self.claims = FakeClaimSource()
        self.prepared: dict[str, str] = {}
        self.publisher = ModelPublisher(self.inventory)
        self.start_agent()

    # --- the agent --------------------------------------------------------------------------

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def start_agent(self) -> None:
        """A (re)start: nothing survives from memory but what the agent re-derives."""
        self.ownership = OwnershipState()
        self.snapshot = None  # PodResources is asked afresh: an answer from before the restart is gone
        self.publisher = ModelPublisher(self.inventory, self.publisher.written)
        cdi = create_cdi_service(self.config, inventory=self.inventories)
        self.dra: DraMechanism = self.run(
            build_dra(
                self.config,
                claims=self.claims,
                publisher=self.publisher,
                inventory=self.inventories,
                ownership=self.ownership,
                health=self.health,
                cdi=cdi,
                registry=None,
                node_name=NODE,
                boot_id=BOOT,
            )
        )
        self.handover = Handover(
            ownership=self.ownership,
            observe={
                DP: lambda: Observed(self.dp_usage(), self.dp_listed()),
                DRA: lambda: Observed(self.dra.usage(), self.publisher.published_gpus()),
            },
            clock=lambda: self.clock,
        )
        self.handover.set_desired(self.desired())

    def desired(self) -> Any:
        gpus = {str(i): owner for i, owner in self.want.items()}
        config = OwnershipConfig(default=DP, nodes=(NodeRule(match=NodeMatch(names=(NODE,)), gpus=gpus),))
        return compute_ownership(self.inventory, config, node_name=NODE, node_labels={}, version=str(gpus))

    def dp_usage(self) -> Usage:
        if not self.podresources_up:
            return Usage(known=False, reason="PodResources down")
        plan = {self.resource.name: self.resource}
        return device_usage(
            self.snapshot, reason="", plan=plan, inventory=self.inventory, own_names=[self.resource.name]
        ).usage

    def dp_listed(self) -> frozenset[str]:
        """What ListAndWatch lists right now (healthy or not)."""
        return frozenset(d.device.gpu_uuid for d in advertised(self.resource, self.ownership.current, self.health))

    # --- the kubelet and the device plugin ---------------------------------------------------

    @rule(pod=NAME, gpu=GPU)
    def kubelet_allocates(self, pod: str, gpu: int) -> None:
        uuid = self.gpus[gpu]
        listed = uuid in self.dp_listed() and self.health.is_healthy(uuid)
        if pod in self.pods or any(p == pod for p, _, _ in self.pending) or not listed:
            return
        try:
            resolve_ids(self.resource, [uuid], ownership=self.ownership.current, health=self.health)
        except AllocationError:
            return
        self.pending.append((pod, uuid, self.clock))

    @precondition(lambda self: self.pending)
    @rule()
    def kubelet_records(self) -> None:
        for pod, uuid, _ in self.pending:
            self.pods[pod] = uuid
        self.pending = []

    @rule(pod=NAME)
    def pod_ends(self, pod: str) -> None:
        self.pods.pop(pod, None)

    @rule()
    def podresources_polled(self) -> None:
        if self.podresources_up:
            held = tuple(ContainerDevices("ns", p, "c", self.resource.name, (u,)) for p, u in self.pods.items())
            self.snapshot = Snapshot(containers=held, as_of=self.clock)

    @rule(up=st.booleans())
    def podresources_availability(self, up: bool) -> None:
        self.podresources_up = up

    # --- the scheduler, the API and DRA ------------------------------------------------------

    @rule(name=NAME, gpu=GPU)
    def scheduler_allocates_and_kubelet_prepares(self, name: str, gpu: int) -> None:
        uuid = self.gpus[gpu]
        if name in self.prepared or uuid not in self.publisher.written:
            return
        ref = self.claims.add(name, result(self.devices[uuid]))
        answer = self.run(self.dra.driver.prepare([ref]))[ref.uid]
        if not answer.error:
            self.prepared[name] = uuid

    @rule(name=NAME)
    def kubelet_unprepares(self, name: str) -> None:
        if name in self.prepared:
            ref = ClaimRef(namespace="default", name=name, uid=f"uid-default-{name}")
            assert self.run(self.dra.driver.unprepare([ref]))[ref.uid] == ""
            del self.prepared[name]

    @rule()
    def slice_write_attempted(self) -> None:
        self.publisher.attempting = self.ownership.current.gpus_granted_to(DRA)

    @rule()
    def slice_write_succeeds(self) -> None:
        self.publisher.written, self.publisher.attempting = self.publisher.attempting, frozenset()
        self.publisher.listed = True

    # --- the operator, the hardware, time ------------------------------------------------------

    @rule(gpu=GPU, owner=OWNERS)
    def config_changes(self, gpu: int, owner: Owner) -> None:
        self.want[gpu] = owner
        self.handover.set_desired(self.desired())

    @rule(gpu=GPU, healthy=st.booleans())
    def health_flips(self, gpu: int, healthy: bool) -> None:
        kind = SignalKind.INJECTED_HEAL if healthy else SignalKind.INJECTED_FAULT
        self.health.observe(Signal(uuid=self.gpus[gpu], kind=kind, detail="test"))

    @rule(dt=st.sampled_from([0.1, 0.4, 1.0]))
    def time_passes(self, dt: float) -> None:
        # the kubelet records an allocation in PodResources well inside the settle window
        if self.pending:
            self.kubelet_records()
        self.clock += dt

    @rule()
    def handover_ticks(self) -> None:
        self.handover.evaluate()

    @rule()
    def agent_restarts(self) -> None:
        # a restart takes far longer than the kubelet takes to record an answered Allocate
        if self.pending:
            self.kubelet_records()
        self.run(self.dra.driver.close())
        self.start_agent()

    # --- what must always hold ----------------------------------------------------------------

    @invariant()
    def never_advertised_by_both(self) -> None:
        both = self.dp_listed() & self.publisher.published_gpus()
        assert not both, f"in ListAndWatch and in a slice: {sorted(both)}"

    @invariant()
    def never_held_through_both(self) -> None:
        dp = set(self.pods.values()) | {u for _, u, _ in self.pending}
        dra = set(self.prepared.values())
        assert not dp & dra, f"held through both mechanisms: {sorted(dp & dra)}"

    @invariant()
    def never_granted_while_the_other_mechanism_holds_it(self) -> None:
        table = self.ownership.current
        dp = set(self.pods.values()) | {u for _, u, _ in self.pending}
        dra = set(self.prepared.values())
        assert not {g for g in dp if not table.granted_to(g, DP)} & table.gpus_granted_to(DRA)
        assert not {g for g in dra if not table.granted_to(g, DRA)} & table.gpus_granted_to(DP)

    def teardown(self) -> None:
        try:
            self._every_drain_completes_once_its_users_are_gone()
        finally:
            with contextlib.suppress(Exception):
                self.run(self.dra.driver.close())
            self.loop.close()
            shutil.rmtree(self.root, ignore_errors=True)

    def _every_drain_completes_once_its_users_are_gone(self) -> None:
        self.pending = []
        self.pods.clear()
        for name in list(self.prepared):
            self.kubelet_unprepares(name)
        self.podresources_up = True
        for _ in range(4):
            self.clock += SETTLE_S + 0.1
            self.podresources_polled()
            self.handover.evaluate()
            self.slice_write_attempted()
            self.slice_write_succeeds()
            self.handover.evaluate()
        table = self.ownership.current
        assert table.draining == {}, {g: d.waiting_for for g, d in table.draining.items()}
        for i, owner in self.want.items():
            assert table.owner_of(self.gpus[i]) is owner


Node.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestNodeOwnership = Node.TestCase
