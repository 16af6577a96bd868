"""The ownership invariant, under random sequences of everything that can happen on a node.

At no instant does a GPU appear both in the device plugin's ListAndWatch and in this node's
ResourceSlices, no GPU is held through both mechanisms at once, and every drain completes once
its users are gone.

The machine drives the real pieces that decide — :class:`~agent.core.ownership.handover.Handover`, the plugin's
``advertised``/``resolve_ids`` (what ListAndWatch lists and Allocate accepts), the PodResources
mapping, the real slice planning (:func:`~agent.dra.slices.plan.desired_slices` and
:func:`~agent.dra.slices.plan.plan`: which devices the pool holds, and the writes that get the
API there), and the real DRA driver with its checkpoint and CDI specs on disk — through the
kubelet's and the scheduler's moves, with their real constraints:

* the kubelet allocates only devices ListAndWatch lists, and PodResources shows an allocation
  a moment after Allocate answered (well inside the handover's settle window);
* the scheduler allocates only devices of slices the API had, but possibly from a slice the API
  replaced a moment ago (a scheduling cycle that started before it saw the new one: up to
  ``SCHEDULER_LAG_S``); the pod is bound then, and the kubelet asks for the claim to be prepared
  later, at any time, or the pod is deleted first; a slice write is attempted, then succeeds (or
  not yet); ``published_gpus`` covers attempted and written (only the API's side is modelled: a
  cluster that keeps no device taints, writes that succeed whole). The agent lists the node's
  pods and reads their claims now and then (:class:`~agent.dra.claims.allocated.AllocatedClaims`);
  a claim allocated from a slice that still listed a GPU is always prepared when the kubelet asks
  (it is never stranded: refused forever, as the scheduler never allocates it again);
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
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from agent.backends.simulated import SimulatedBackend
from agent.cdi.service import create_cdi_service
from agent.core.config.schema import HealthConfig, NodeMatch, NodeRule, Owner, OwnershipConfig, PluginConfig
from agent.core.health.model import Signal, SignalKind
from agent.core.health.monitor import HealthMonitor
from agent.core.inventory.current import InventoryState
from agent.core.inventory.model import Inventory
from agent.core.mechanism import Readiness, Usage
from agent.core.node import NodeFacts
from agent.core.ownership.handover import DRA_SETTLE_S, Handover, Observed
from agent.core.ownership.table import OwnershipState, compute_ownership
from agent.deviceplugin.allocate import resolve_ids
from agent.deviceplugin.errors import AllocationError
from agent.deviceplugin.podresources import ContainerDevices, Snapshot
from agent.deviceplugin.resources import advertised, plan_resources
from agent.deviceplugin.usage import device_usage
from agent.dra.devices import dra_devices
from agent.dra.mechanism import DraMechanism, DraTuning, build_dra
from agent.dra.slices.plan import Plan, SliceDevice, StoredSlice, desired_slices, plan
from agent.kube.claims.model import ClaimRef
from agent.kube.podclaims import PodClaims
from tests.dra_fakes import BOOT, NODE, FakeClaimSource, make_config, result
from tests.test_ownership import granted_gpus

DP, DRA, NONE = Owner.DEVICE_PLUGIN, Owner.DRA, Owner.NONE
N_GPUS = 3
OWNERS = st.sampled_from([DP, DRA, NONE])
GPU = st.integers(min_value=0, max_value=N_GPUS - 1)
NAME = st.sampled_from([f"w{i}" for i in range(4)])
NODE_UID = "node-uid"
#: how long after the API replaced a slice the scheduler may still allocate from the old one
SCHEDULER_LAG_S = 1.0
assert SCHEDULER_LAG_S < DRA_SETTLE_S


class ModelPods:
    """The node's pods as the API lists them: those with a claim allocated or prepared."""

    def __init__(self, node: Node) -> None:
        self.node = node

    async def list(self) -> list[PodClaims]:
        await asyncio.sleep(0)
        return [
            PodClaims(namespace="default", pod=f"pod-{name}", uid=f"pod-{ref.uid}", claims=(name,))
            for name, ref in self.node.refs.items()
        ]


class ModelPublisher:
    """The ResourceSlice publisher as the scheduler sees it: the slices the API has, a write
    attempted, whether it has listed; what to write comes from the real planning functions."""

    def __init__(self, inventory: Inventory, stored: tuple[StoredSlice, ...] = ()) -> None:
        self._all = frozenset(d.gpu_uuid for d in dra_devices(inventory))
        self.stored = stored  # what the API has
        #: a write attempted and not answered yet: its plan and the slices it writes
        self.writing: tuple[Plan, tuple[tuple[SliceDevice, ...], ...]] | None = None
        self.listed = False  # a fresh publisher trusts nothing until it has listed

    def published_gpus(self) -> frozenset[str]:
        gpus = {gpu for s in self.stored for gpu in s.gpus}
        if self.writing is not None:
            gpus |= {d.gpu_uuid for devices in self.writing[1] for d in devices}
        if not self.listed:
            gpus |= self._all
        return frozenset(gpus)

    def stored_devices(self) -> frozenset[str]:
        return frozenset(d.name for s in self.stored for d in s.devices)

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
        # the API server: claims the scheduler allocated (their pods bound), prepared ones, and the
        # devices of the stored slices over time (what the scheduler may still allocate from)
        self.claims = FakeClaimSource()
        self.refs: dict[str, ClaimRef] = {}
        self.allocated: dict[str, str] = {}
        self.prepared: dict[str, str] = {}
        self.stored_history: list[tuple[float, frozenset[str]]] = [(float("-inf"), frozenset())]
        self.serial = 0
        self.publisher = ModelPublisher(self.inventory)
        self.start_agent()

    # --- the agent --------------------------------------------------------------------------

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def start_agent(self) -> None:
        """A (re)start: nothing survives from memory but what the agent re-derives."""
        self.ownership = OwnershipState()
        self.snapshot = None  # a new process has not asked PodResources yet
        self.publisher = ModelPublisher(self.inventory, self.publisher.stored)
        cdi = create_cdi_service(self.config, inventory=self.inventories)
        self.dra: DraMechanism = self.run(
            build_dra(
                self.config,
                claims=self.claims,
                publisher=self.publisher,
                node=NodeFacts(inventory=self.inventories, health=self.health, ownership=self.ownership),
                cdi=cdi,
                registry=None,
                node_name=NODE,
                boot_id=BOOT,
                tuning=DraTuning(clock=lambda: self.clock),
                pods=ModelPods(self),
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

    @initialize(owners=st.lists(OWNERS, min_size=N_GPUS, max_size=N_GPUS))
    def settled_node(self, owners: list[Owner]) -> None:
        """The node starts in a settled state with any split, so that handovers are a few steps away."""
        for gpu, owner in enumerate(owners):
            self.want[gpu] = owner
        self.handover.set_desired(self.desired())
        self.settle()

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

    def schedulable(self) -> frozenset[str]:
        """Device names the scheduler may allocate now: in a slice the API has or had a moment ago."""
        return (
            frozenset(d for at, devices in self.stored_history for d in devices if at >= self.clock - SCHEDULER_LAG_S)
            | self.stored_history[-1][1]
        )

    @rule(name=NAME, gpu=GPU)
    def scheduler_allocates(self, name: str, gpu: int) -> None:
        """Allocated from the slices the scheduler saw, and the pod bound; no Prepare yet."""
        uuid = self.gpus[gpu]
        taken = set(self.allocated.values()) | set(self.prepared.values())
        if name in self.refs or uuid in taken or self.devices[uuid] not in self.schedulable():
            return
        self.serial += 1
        self.refs[name] = self.claims.add(name, result(self.devices[uuid]), uid=f"uid-{name}-{self.serial}")
        self.allocated[name] = uuid

    @rule(name=NAME)
    def kubelet_prepares(self, name: str) -> None:
        if name not in self.allocated:
            return
        ref = self.refs[name]
        uuid = self.allocated[name]
        answer = self.run(self.dra.driver.prepare([ref]))[ref.uid]
        if answer.error:
            # refused while the GPU is unhealthy, or while a drain derived at start still waits on
            # another mechanism (the kubelet retries); refused for good it would be stranded: the
            # scheduler never allocates it again
            drain = self.ownership.current.draining.get(uuid)
            temporary = not self.health.is_healthy(uuid) or (drain is not None and drain.source is not DRA)
            assert temporary, f"claim allocated on a DRA device refused: {answer.error}"
            return
        self.prepared[name] = self.allocated.pop(name)

    @rule(name=NAME)
    def pod_deleted_before_its_claim_was_prepared(self, name: str) -> None:
        if name in self.allocated:
            del self.allocated[name], self.refs[name]
            self.claims.claims.pop(("default", name), None)

    @rule(name=NAME)
    def kubelet_unprepares(self, name: str) -> None:
        if name in self.prepared:
            ref = self.refs.pop(name)
            assert self.run(self.dra.driver.unprepare([ref]))[ref.uid] == ""
            del self.prepared[name]
            self.claims.claims.pop(("default", name), None)

    @rule()
    def agent_lists_the_nodes_pods(self) -> None:
        self.run(self.dra.allocated.refresh())

    @rule()
    def slice_write_attempted(self) -> None:
        """The publisher's sync: the pool from inventory, grants and health, and the writes to it."""
        driver = self.config.dra.driver_name
        desired = desired_slices(
            dra_devices(self.inventory),
            ownership=self.ownership.current,
            health=self.health,
            driver=driver,
            taints=False,
        )
        assert desired is not None
        writes = plan(desired, self.publisher.stored, node=NODE, driver=driver, node_uid=NODE_UID)
        self.publisher.writing = None if writes.empty else (writes, desired)

    @rule()
    def slice_write_succeeds(self) -> None:
        if self.publisher.writing is not None:
            writes, desired = self.publisher.writing
            self.publisher.stored = tuple(
                StoredSlice(
                    name=f"{NODE}-slice-{writes.generation}-{i}",
                    uid=f"uid-{writes.generation}-{i}",
                    resource_version="1",
                    driver=self.config.dra.driver_name,
                    pool=NODE,
                    generation=writes.generation,
                    count=writes.count,
                    node_name=NODE,
                    devices=devices,
                    owner_uid=NODE_UID,
                )
                for i, devices in enumerate(desired)
            )
            self.stored_history.append((self.clock, self.publisher.stored_devices()))
        self.publisher.writing = None
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
        dra = set(self.prepared.values()) | set(self.allocated.values())
        assert not dp & dra, f"held through both mechanisms: {sorted(dp & dra)}"

    @invariant()
    def an_allocated_claim_is_never_stranded(self) -> None:
        """Its GPU stays DRA's, or drains (and the drain waits for it), until it is prepared."""
        table = self.ownership.current
        for name, uuid in self.allocated.items():
            ok = table.granted_to(uuid, DRA) or uuid in table.draining
            assert ok, f"claim {name} on {uuid} stranded: {table.state_of(uuid)}"

    @invariant()
    def never_granted_while_the_other_mechanism_holds_it(self) -> None:
        table = self.ownership.current
        dp = set(self.pods.values()) | {u for _, u, _ in self.pending}
        dra = set(self.prepared.values()) | set(self.allocated.values())
        assert not {g for g in dp if not table.granted_to(g, DP)} & granted_gpus(table, DRA)
        assert not {g for g in dra if not table.granted_to(g, DRA)} & granted_gpus(table, DP)

    def teardown(self) -> None:
        try:
            self._every_drain_completes_once_its_users_are_gone()
        finally:
            with contextlib.suppress(Exception):
                self.run(self.dra.driver.close())
            self.loop.close()
            shutil.rmtree(self.root, ignore_errors=True)

    def settle(self) -> None:
        """Time enough passes, with PodResources up and every slice write going through, for every
        drain whose users are gone to complete."""
        self.podresources_up = True
        for _ in range(4):
            self.clock += DRA_SETTLE_S + 0.1
            self.podresources_polled()
            self.agent_lists_the_nodes_pods()
            self.handover.evaluate()
            self.slice_write_attempted()
            self.slice_write_succeeds()
            self.handover.evaluate()

    def _every_drain_completes_once_its_users_are_gone(self) -> None:
        self.pending = []
        self.pods.clear()
        for gpu in range(N_GPUS):
            self.health_flips(gpu, healthy=True)
        self.settle()
        for name in list(self.allocated):
            self.kubelet_prepares(name)  # every allocated claim is prepared when the kubelet asks
        assert not self.allocated, {n: self.ownership.current.state_of(u) for n, u in self.allocated.items()}
        for name in list(self.prepared):
            self.kubelet_unprepares(name)
        self.settle()
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


def test_a_claim_allocated_from_the_old_slice_is_prepared_when_the_kubelet_asks_later() -> None:
    """Seen on a real cluster: GPU 0 moves from DRA to the device plugin; a pod created at that
    moment got GPU 0 from the slice that still listed it. The kubelet asks for the claim only
    after the slice changed: it is prepared, and GPU 0 waits for it."""
    node = Node()
    try:
        node.settled_node([DRA, DP, DP])
        node.scheduler_allocates("w0", 0)  # from the slice the scheduler saw
        node.config_changes(0, DP)
        node.slice_write_attempted()
        node.slice_write_succeeds()  # the slice without GPU 0
        node.time_passes(1.0)
        node.handover_ticks()
        node.agent_lists_the_nodes_pods()
        for _ in range(4):
            node.time_passes(1.0)
            node.podresources_polled()
            node.agent_lists_the_nodes_pods()
            node.handover_ticks()
        assert node.ownership.current.state_of(node.gpus[0]) == "draining:dra->device-plugin"
        assert "w0" in node.ownership.current.draining[node.gpus[0]].waiting_for
        node.kubelet_prepares("w0")
        assert node.prepared == {"w0": node.gpus[0]}
        node.kubelet_unprepares("w0")
        node.settle()
        assert node.ownership.current.granted_to(node.gpus[0], DP)
    finally:
        node.teardown()


def gpu0_waits_for_w0_then_goes_to_the_device_plugin(node: Node) -> None:
    """Seconds pass with the kubelet and the pod list answering: GPU 0 waits for claim w0 until
    the kubelet has prepared and unprepared it, then it is the device plugin's."""
    for _ in range(4):
        node.time_passes(1.0)
        node.podresources_polled()
        node.agent_lists_the_nodes_pods()
        node.handover_ticks()
        node.an_allocated_claim_is_never_stranded()
    assert "w0" in node.ownership.current.draining[node.gpus[0]].waiting_for
    node.kubelet_prepares("w0")
    node.kubelet_unprepares("w0")
    node.settle()
    assert node.ownership.current.granted_to(node.gpus[0], DP)


def test_a_claim_allocated_before_a_restart_holds_its_gpu_when_the_config_turns_back() -> None:
    """Found by the state machine: GPU 0 is DRA's and a claim is allocated on it; the agent
    restarts (every GPU's owner derived again, GPU 0 first a drain from the device plugin, whose
    PodResources has not answered yet); GPUs 1 and 2 are given to DRA, then GPU 0 back to the
    device plugin.
    The claim, allocated but not prepared, must still hold GPU 0: turning a derived drain back is a
    new grant, so GPU 0 drains from DRA, which must look at the node's pods a settle after GPU 0
    left its slice."""
    node = Node()
    try:
        node.settled_node([DRA, DP, DP])
        node.scheduler_allocates("w0", 0)
        node.agent_restarts()
        node.slice_write_attempted()
        node.slice_write_succeeds()
        node.config_changes(1, DRA)  # now no drain is away from DRA: only the derived ones are left
        node.config_changes(2, DRA)
        node.config_changes(0, DP)
        node.an_allocated_claim_is_never_stranded()
        assert node.ownership.current.state_of(node.gpus[0]) == "draining:dra->device-plugin"
        gpu0_waits_for_w0_then_goes_to_the_device_plugin(node)
    finally:
        node.teardown()


def test_a_claim_allocated_after_the_pods_were_listed_is_not_missed_when_the_config_turns_back() -> None:
    """Found by the state machine: after a restart the agent lists the node's pods, then the
    scheduler allocates a claim on GPU 0 from the slice of the earlier run, which still lists it;
    then the config gives GPU 0 to the device plugin. The list was older than the claim: only a
    list made a settle after GPU 0 left the slice may let it go."""
    node = Node()
    try:
        node.settled_node([DRA, DP, DP])
        node.agent_restarts()
        node.agent_lists_the_nodes_pods()
        node.slice_write_attempted()
        node.scheduler_allocates("w0", 0)
        node.slice_write_succeeds()
        node.config_changes(0, DP)
        node.an_allocated_claim_is_never_stranded()
        gpu0_waits_for_w0_then_goes_to_the_device_plugin(node)
    finally:
        node.teardown()
