"""No pod fails at admission because a GPU leaves the device plugin, whatever the timing.

The real pieces decide — the :class:`~agent.core.ownership.handover.Handover`, what ListAndWatch
lists (:func:`~agent.deviceplugin.resources.advertised`), the ceilings the Node is lowered to and
when a closing GPU may go (:mod:`agent.deviceplugin.nodeview`) — and the peers move as a real
v1.36 scheduler and kubelet do (measured on one, ``scripts/e2e-real``):

* the scheduler binds a pod asking for one GPU whenever the Node's allocatable (as the API has
  it) exceeds the GPUs its pods on the node request;
* the kubelet's device manager follows ListAndWatch at once, but writes the Node only at its
  status syncs, which may come at any moment, computed from what it has then (so a sync while a
  closing GPU is still listed raises the count the agent had lowered);
* the kubelet admits a bound pod within ``ADMIT_MAX_S`` of its binding, with a free device it
  holds, or fails it (``UnexpectedAdmissionError``): that must never happen;
* the agent's Node gate reads the Node now and then and lowers what is above its ceiling.

Health is left out: a GPU that breaks is refused by the kubelet at once, whatever the agent does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from agent.backends.simulated import SimulatedBackend
from agent.core.config.schema import HealthConfig, NodeMatch, NodeRule, Owner, OwnershipConfig, PluginConfig
from agent.core.health.monitor import HealthMonitor
from agent.core.mechanism import NodeCeiling
from agent.core.ownership.handover import IDLE, Handover, Observed
from agent.core.ownership.table import OwnershipState, compute_ownership
from agent.deviceplugin.nodeview import GRACE_S, closed_gpus, node_ceilings
from agent.deviceplugin.podresources import ContainerDevices, Snapshot
from agent.deviceplugin.resources import advertised, plan_resources
from agent.deviceplugin.usage import device_usage

DP, DRA, NONE = Owner.DEVICE_PLUGIN, Owner.DRA, Owner.NONE
N_GPUS = 3
NODE = "node-a"
#: a bound pod reaches the kubelet's admission within this (the real one: well under a second)
ADMIT_MAX_S = 0.5
assert ADMIT_MAX_S < GRACE_S
POD = st.sampled_from([f"p{i}" for i in range(5)])


class NodeGate:
    """The Node gate (``NodeCountsGuard``) as the handover sees it; the machine runs its reads."""

    def __init__(self, node: AdmissionNode) -> None:
        self.node = node
        self.ceilings: dict[str, NodeCeiling] = {}
        self.held: dict[str, float] = {}

    def lower_to(self, ceilings: Mapping[str, NodeCeiling]) -> None:
        for name, ceiling in ceilings.items():
            old = self.ceilings.get(name)
            if old is None or ceiling.allocatable < old.allocatable:
                self.held.pop(name, None)
        self.ceilings = dict(ceilings)

    def held_since(self, resource: str) -> float | None:
        return self.held.get(resource)

    def debug_state(self) -> dict[str, object]:
        return {}

    def reads_the_node(self) -> None:
        """One read, and the patch when the Node shows more than the ceiling."""
        for name, ceiling in self.ceilings.items():
            if self.node.node_count > ceiling.allocatable:
                self.node.node_count = ceiling.allocatable
                self.held[name] = self.node.clock
            else:
                self.held.setdefault(name, self.node.clock)


class AdmissionNode(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        full = asyncio.run(SimulatedBackend(preset="h100-8x-nvlink", node_name=NODE, health=HealthConfig()).load())
        self.inventory = replace(full, gpus=full.gpus[:N_GPUS])
        self.gpus = [g.uuid for g in self.inventory.gpus]
        self.resource = plan_resources(self.inventory, PluginConfig()).resources[0]
        self.health = HealthMonitor(config=HealthConfig())
        self.health.set_inventory(self.inventory)
        self.clock = 100.0
        self.want: dict[int, Owner] = dict.fromkeys(range(N_GPUS), DP)
        # the kubelet: running pods and their device, bound pods not admitted yet, its Node count
        self.running: dict[str, str] = {}
        self.bound: dict[str, float] = {}
        self.node_count = N_GPUS
        self.snapshot: Snapshot | None = None
        self.gate = NodeGate(self)
        self.ownership = OwnershipState()
        self.handover = Handover(
            ownership=self.ownership,
            observe={DP: self.dp_observed, DRA: lambda: IDLE},
            clock=lambda: self.clock,
        )
        self.handover.set_desired(self.desired())
        self.podresources_polled()
        self.handover.evaluate()
        self.gate.lower_to(self.ceilings())

    def desired(self) -> Any:
        gpus = {str(i): owner for i, owner in self.want.items()}
        config = OwnershipConfig(default=DP, nodes=(NodeRule(match=NodeMatch(names=(NODE,)), gpus=gpus),))
        return compute_ownership(self.inventory, config, node_name=NODE, node_labels={}, version=str(gpus))

    def listed(self) -> set[str]:
        """What the kubelet's device manager holds: the list ListAndWatch sent last (at once)."""
        return {d.device.id for d in advertised(self.resource, self.ownership.current, self.health)}

    def ceilings(self) -> dict[str, NodeCeiling]:
        return node_ceilings([self.resource], self.ownership.current, self.health)

    def dp_observed(self) -> Observed:
        plan = {self.resource.name: self.resource}
        usage = device_usage(
            self.snapshot, reason="", plan=plan, inventory=self.inventory, own_names=[self.resource.name]
        ).usage
        view = closed_gpus([self.resource], self.ownership.current, self.gate, self.clock).view
        listed = frozenset(self.resource.gpu_of[i] for i in self.listed())
        return Observed(usage, listed, closed=view.closed, closing_note=view.note)

    def after_grants_change(self) -> None:
        """The plugin pushes its ceilings whenever its list may have changed, and the gate reads the
        Node at once (milliseconds in the real one, taken as instant here)."""
        self.gate.lower_to(self.ceilings())
        self.gate.reads_the_node()

    # --- the scheduler and the kubelet ---------------------------------------------------------

    @rule(pod=POD)
    def scheduler_binds(self, pod: str) -> None:
        if pod in self.running or pod in self.bound:
            return
        if self.node_count > len(self.running) + len(self.bound):
            self.bound[pod] = self.clock

    @rule(pod=POD)
    def kubelet_admits(self, pod: str) -> None:
        if pod not in self.bound:
            return
        del self.bound[pod]
        free = sorted(self.listed() - set(self.running.values()))
        assert free, f"pod {pod} failed at admission: no free device (node count {self.node_count})"
        self.running[pod] = free[0]

    @rule(pod=POD)
    def pod_ends(self, pod: str) -> None:
        self.running.pop(pod, None)

    @rule()
    def kubelet_status_sync(self) -> None:
        self.node_count = len(self.listed())

    @rule()
    def podresources_polled(self) -> None:
        held = tuple(ContainerDevices("ns", p, "c", self.resource.name, (d,)) for p, d in self.running.items())
        self.snapshot = Snapshot(containers=held, as_of=self.clock)

    # --- the agent ----------------------------------------------------------------------------

    @rule()
    def gate_reads_the_node(self) -> None:
        self.gate.reads_the_node()

    @rule()
    def handover_ticks(self) -> None:
        self.handover.evaluate()
        self.after_grants_change()

    @rule(gpu=st.integers(min_value=0, max_value=N_GPUS - 1), owner=st.sampled_from([DP, DRA, NONE]))
    def config_changes(self, gpu: int, owner: Owner) -> None:
        self.want[gpu] = owner
        self.handover.set_desired(self.desired())
        self.after_grants_change()

    @rule(dt=st.sampled_from([0.1, 0.2]))
    def time_passes(self, dt: float) -> None:
        # the kubelet admits a bound pod within ADMIT_MAX_S of its binding; the gate reads the Node
        # every 0.2 s while a GPU closes
        for pod, at in sorted(self.bound.items()):
            if at + ADMIT_MAX_S <= self.clock + dt:
                self.kubelet_admits(pod)
        if any(d.closing for d in self.ownership.current.draining.values()):
            self.gate.reads_the_node()
        self.clock += dt

    @invariant()
    def every_bound_pod_can_still_be_admitted(self) -> None:
        free = self.listed() - set(self.running.values())
        assert len(self.bound) <= len(free) or any(d.closing for d in self.ownership.current.draining.values()), (
            f"{len(self.bound)} pods bound, {len(free)} devices free"
        )


AdmissionNode.TestCase.settings = settings(
    max_examples=80, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestNoPodFailsAtAdmission = AdmissionNode.TestCase


def test_a_pod_bound_just_before_the_node_was_lowered_gets_the_closing_gpu() -> None:
    """The scheduler bound a pod on the Node's old count; the agent lowers the Node and keeps the
    GPU listed; the kubelet admits the pod with it; only then does the GPU go."""
    node = AdmissionNode()
    for pod in ("p0", "p1"):
        node.scheduler_binds(pod)
        node.kubelet_admits(pod)
    node.scheduler_binds("p2")  # on the count of 3, just before the switch
    node.config_changes(2, DRA)
    node.gate_reads_the_node()
    assert node.node_count == 2 and node.ownership.current.draining[node.gpus[2]].closing
    node.kubelet_status_sync()  # computed while GPU 2 is still listed: back to 3
    assert node.node_count == 3
    node.time_passes(0.3)
    node.gate_reads_the_node()
    node.handover_ticks()
    node.kubelet_admits("p2")
    assert node.running["p2"] == node.gpus[2]
    for _ in range(5):
        node.time_passes(0.3)
        node.gate_reads_the_node()
        node.podresources_polled()
        node.handover_ticks()
    assert "p2" in node.ownership.current.draining[node.gpus[2]].waiting_for


def test_a_kubelet_status_write_just_before_the_gpu_goes_is_undone_when_it_goes() -> None:
    """The kubelet's status sync lands in the last moment of the grace, with the closing GPU still
    counted: the gate reads the Node again when the plugin's list changes, before a pod can be
    bound on the stale count."""
    node = AdmissionNode()
    node.config_changes(2, NONE)
    node.gate_reads_the_node()
    for _ in range(5):
        node.time_passes(0.2)
    node.kubelet_status_sync()  # GPU 2 still listed: the count is 3 again
    assert node.node_count == 3 and node.ownership.current.draining[node.gpus[2]].closing
    node.handover_ticks()  # the grace has passed: GPU 2 leaves ListAndWatch
    assert not node.ownership.current.draining[node.gpus[2]].closing
    assert node.node_count == 2
    for pod in ("p0", "p1", "p2"):
        node.scheduler_binds(pod)
        node.kubelet_admits(pod)
    assert sorted(node.running) == ["p0", "p1"]
