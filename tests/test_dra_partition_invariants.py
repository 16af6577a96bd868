"""No two prepared claims ever overlap on a GPU, and shares never exceed its memory — under random
sequences of claims, prepares, unprepares, hardware failures, mode changes and restarts.

The machine drives the real DRA driver (plan, reservations, MIG instances, MPS, CDI specs and
the checkpoint on disk) on a node with two MIG-capable GPUs in MIG mode and two that are not,
against a hardware model (:class:`~tests.partition_fakes.FakeMig`) that outlives agent
restarts, as real MIG instances do. The scheduler is hostile: it allocates any device of the
current slices, overlapping or not, and any amount of a shared GPU's memory; the driver is the
last line of defence. After every step:

* no two prepared claims hold overlapping MIG placements, or a whole GPU next to anything else;
* the memory of the shares prepared on a GPU adds up to no more than the GPU has;
* every prepared partition's instance exists at its placement, every instance the agent
  recorded exists, and every instance that exists was recorded by the agent or made by someone
  else (nothing leaks); someone else's instances are never destroyed.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from agent.core.partitioning import PartitionErrorKind
from agent.kube.claims.model import ClaimRef
from tests.dra_fakes import DraHarness, dra_harness, result

NAMES = st.sampled_from([f"c{i}" for i in range(6)])
MIG_GPUS = (0, 1)
SHARED_GPUS = (2, 3)
PUBLISH = {
    "default": "dynamic-mig",
    "nodes": [{"match": {"names": ["node-a"]}, "gpus": {"2": "shared", "3": "shared", "4": "whole"}}],
}
GIB = 1 << 30


class PartitionedNode(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self._context = dra_harness(start=False, mig=True, mig_enabled=MIG_GPUS, publish=PUBLISH)
        self.h: DraHarness = self.run(self._context.__aenter__())
        self.run(self.h.build())
        self.run(self.h.m.driver.start())
        self.foreign: set[str] = set()

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def ref(self, name: str) -> ClaimRef:
        return ClaimRef(namespace="default", name=name, uid=f"uid-default-{name}")

    # --- the scheduler and the kubelet -----------------------------------------------------------

    @rule(name=NAMES, picks=st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=3))
    def allocate_and_prepare(self, name: str, picks: list[int]) -> None:
        """Any devices of the slices now, overlapping or not: the driver must refuse what collides."""
        devices = self.h.m.driver.gate.devices()
        if not devices:
            return
        results = []
        for i, pick in enumerate(picks):
            device = devices[pick % len(devices)]
            if device.share is not None:
                memory = f"{1 + pick % 60}Gi"
                results.append(result(device.name, request=f"r{i}", share_id=f"{name}-{pick}-{i}", memory=memory))
            else:
                results.append(result(device.name, request=f"r{i}"))
        if self.ref(name).uid not in self.h.m.driver.prepared:
            self.h.claims.add(name, *results)
        self.run(self.h.m.driver.prepare([self.ref(name)]))

    @rule(a=NAMES, b=NAMES, pick=st.integers(min_value=0, max_value=10_000))
    def two_calls_at_once(self, a: str, b: str, pick: int) -> None:
        """Two kubelet calls for different claims on the same device, concurrently."""
        devices = self.h.m.driver.gate.devices()
        if not devices or a == b:
            return
        device = devices[pick % len(devices)]
        for name in (a, b):
            if self.ref(name).uid not in self.h.m.driver.prepared:
                memory = "30Gi" if device.share is not None else None
                share = f"{name}-{pick}" if device.share is not None else None
                self.h.claims.add(name, result(device.name, share_id=share, memory=memory))

        async def both() -> None:
            await asyncio.gather(self.h.m.driver.prepare([self.ref(a)]), self.h.m.driver.prepare([self.ref(b)]))

        self.run(both())

    @rule(name=NAMES)
    def unprepare(self, name: str) -> None:
        self.run(self.h.m.driver.unprepare([self.ref(name)]))

    # --- the hardware, the operator, the agent ---------------------------------------------------

    @rule(kind=st.sampled_from(list(PartitionErrorKind)))
    def next_create_fails(self, kind: PartitionErrorKind) -> None:
        assert self.h.mig is not None
        self.h.mig.fail_create.append(kind)

    @rule(kind=st.sampled_from([PartitionErrorKind.IN_USE, PartitionErrorKind.FAILED]))
    def next_destroy_fails(self, kind: PartitionErrorKind) -> None:
        assert self.h.mig is not None
        self.h.mig.fail_destroy.append(kind)

    @rule(gpu=st.sampled_from(MIG_GPUS), start=st.integers(min_value=0, max_value=6))
    def someone_else_makes_an_instance(self, gpu: int, start: int) -> None:
        assert self.h.mig is not None
        with contextlib.suppress(Exception):  # the hardware refuses an occupied placement
            self.foreign.add(self.h.mig.add_foreign(self.h.gpu(gpu), 19, start).uuid)
            self.run(self.h.reload())

    @rule(gpu=st.sampled_from((*MIG_GPUS, *SHARED_GPUS)), mode=st.sampled_from(["dynamic-mig", "shared", "whole"]))
    def mode_changes(self, gpu: int, mode: str) -> None:
        nodes = PUBLISH["nodes"][0]  # type: ignore[index]
        self.h.set_publish({"default": "dynamic-mig", "nodes": [{**nodes, "gpus": {**nodes["gpus"], str(gpu): mode}}]})

    @rule()
    def agent_restarts(self) -> None:
        self.run(self.h.m.driver.close())
        self.h.mechanism = None
        self.run(self.h.build())
        self.run(self.h.m.driver.start())

    # --- what must always hold -------------------------------------------------------------------

    @invariant()
    def no_two_claims_overlap(self) -> None:
        held: dict[str, list[tuple[str, Any]]] = {}
        for uid, claim in self.h.m.driver.prepared.items():
            for d in claim.devices:
                held.setdefault(d.gpu_uuid, []).append((uid, d))
        for gpu, devices in held.items():
            for i, (uid_a, a) in enumerate(devices):
                for uid_b, b in devices[i + 1 :]:
                    if uid_a == uid_b or a.admin_access or b.admin_access:
                        continue
                    if a.is_share and b.is_share:
                        continue
                    if a.is_mig and b.is_mig and a.placement is None and b.placement is None:
                        assert a.uuid != b.uuid, f"{gpu}: {a.name} twice"  # MIG devices that existed
                        continue
                    assert a.placement is not None and b.placement is not None, f"{gpu}: {a.name} with {b.name}"
                    assert not a.placement.overlaps(b.placement), f"{gpu}: {a.name} overlaps {b.name}"

    @invariant()
    def shares_never_exceed_the_memory(self) -> None:
        used: dict[str, int] = {}
        for claim in self.h.m.driver.prepared.values():
            for d in claim.devices:
                if d.share_memory is not None:
                    used[d.gpu_uuid] = used.get(d.gpu_uuid, 0) + d.share_memory
        for gpu, memory in used.items():
            found = self.h.inventory.find(gpu)
            assert found is not None and memory <= found.memory_mib << 20, f"{gpu}: {memory} bytes of shares"

    @invariant()
    def instances_match_the_records(self) -> None:
        assert self.h.mig is not None
        existing = {m.uuid: m for ms in self.h.mig.instances_by_gpu.values() for m in ms}
        records = self.h.m.driver.prepared.instances
        recorded = {r.uuid for r in records if r.uuid is not None}
        # an instance whose creation was recorded but never confirmed is known by its place
        announced = {(r.gpu_uuid, r.placement) for r in records if r.uuid is None}
        recorded |= {m.uuid for m in existing.values() if (m.parent_uuid, m.placement) in announced}
        assert self.foreign <= set(existing), "someone else's instance was destroyed"
        assert recorded <= set(existing), f"recorded but gone: {sorted(recorded - set(existing))}"
        assert set(existing) <= recorded | self.foreign, f"leaked: {sorted(set(existing) - recorded - self.foreign)}"
        for claim in self.h.m.driver.prepared.values():
            for d in claim.devices:
                if d.placement is not None:
                    made = existing.get(d.uuid)
                    assert made is not None and made.placement == d.placement, f"{d.name}: no instance"

    @invariant()
    def count(self) -> None:
        assert self.h.mig is not None
        event(f"prepared claims: {min(len(self.h.m.driver.prepared), 3)}")
        event(f"instances: {min(self.h.mig.count(), 4)}")

    def teardown(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self.h.m.driver.close())
        self.run(self._context.__aexit__(None, None, None))
        self.loop.close()


PartitionedNode.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPartitionInvariants = PartitionedNode.TestCase
