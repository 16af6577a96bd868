"""Concurrent prepares of overlapping claims never hand one device to two claims.

Driven at the domain level (no gRPC) so Hypothesis can try many interleavings quickly: a
fake API and a fake CDI service that yield a random number of times, calls that overlap in
time, claims that overlap in devices; the checkpoint is real.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from agent.backends.simulated import SimulatedBackend
from agent.cdi.claimenv import ClaimDevices
from agent.cdi.errors import CdiError
from agent.core.health.monitor import HealthMonitor
from agent.core.inventory.current import InventoryState
from agent.core.node import NodeFacts
from agent.core.ownership.table import OwnershipState
from agent.dra.claims.checkpoint import CheckpointStore
from agent.dra.claims.driver import DraDriver, PrepareTimeouts
from agent.dra.claims.prepared import PreparedClaims
from agent.dra.claims.specwriter import ClaimSpecWriter
from agent.dra.metrics import DraMetrics
from agent.kube.claims.model import ClaimRef, ResourceClaim
from tests.dra_fakes import DRIVER, HEALTH, NODE, FakeClaimSource, ownership_table, result


class YieldingClaims(FakeClaimSource):
    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng

    async def get_claim(self, ref: ClaimRef) -> ResourceClaim | None:
        for _ in range(self.rng.randrange(4)):
            await asyncio.sleep(0)
        return await super().get_claim(ref)


class YieldingCdi:
    """The CDI calls the driver makes, in memory, yielding like file I/O in a thread would."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.specs: dict[str, tuple[str, ...]] = {}

    async def prepare_claims(self, claims: Mapping[str, ClaimDevices]) -> dict[str, list[str] | CdiError]:
        for _ in range(self.rng.randrange(4)):
            await asyncio.sleep(0)
        for uid, claim in claims.items():
            self.specs[uid] = claim.devices
        return {uid: [f"k/claim={uid}-{d}" for d in claim.devices] for uid, claim in claims.items()}

    async def unprepare_claims(self, claim_uids: Sequence[str]) -> dict[str, CdiError | None]:
        await asyncio.sleep(0)
        for uid in claim_uids:
            self.specs.pop(uid, None)
        return dict.fromkeys(claim_uids)


async def scenario(claims: list[frozenset[int]], batches: int, seed: int, directory: Path) -> None:
    rng = random.Random(seed)
    inventory = await SimulatedBackend(preset="h100-8x-nvlink", node_name=NODE, health=HEALTH).load()
    health = HealthMonitor(config=HEALTH)
    health.set_inventory(inventory)
    source = YieldingClaims(rng)
    cdi = YieldingCdi(rng)
    store = CheckpointStore(directory)
    metrics = DraMetrics(CollectorRegistry())
    driver = DraDriver(
        driver_name=DRIVER,
        pool=NODE,
        claims=source,
        node=NodeFacts(
            inventory=InventoryState(inventory), health=health, ownership=OwnershipState(ownership_table(inventory))
        ),
        prepared=PreparedClaims(store, boot_id="b", metrics=metrics),
        specs=ClaimSpecWriter(cdi),  # type: ignore[arg-type]
        metrics=metrics,
        timeouts=PrepareTimeouts(held_s=0.01),  # a claim a prepared one holds is refused at once
    )
    refs = [
        source.add(f"c{i}", *(result(f"gpu-{g}", request=f"r{g}") for g in sorted(gpus)))
        for i, gpus in enumerate(claims)
    ]
    wanted = {ref.uid: gpus for ref, gpus in zip(refs, claims, strict=True)}
    groups = [refs[i::batches] for i in range(batches)]
    # the same claims again in another call, overlapping in time: answered once each, consistently
    groups.append(rng.sample(refs, k=min(len(refs), 3)))
    answers = await asyncio.gather(*(driver.prepare(group) for group in groups))

    for group, answer in zip(groups, answers, strict=True):
        assert set(answer) == {r.uid for r in group}
    prepared = {uid for answer in answers for uid, a in answer.items() if not a.error}
    for answer in answers:
        for uid, a in answer.items():
            assert bool(a.error) == (uid not in prepared), "one claim answered both ways"
            if a.error:
                assert "already" in a.error, a.error
            else:
                assert {int(d.device.split("-")[1]) for d in a.devices} == wanted[uid]
    held = [g for uid in prepared for g in wanted[uid]]
    assert len(held) == len(set(held)), "a device went to two claims"
    assert set(driver.prepared) == prepared == set(cdi.specs)
    assert set(store.load().claims) == prepared
    # every failed claim really overlaps one that got its device
    for uid in set(wanted) - prepared:
        assert wanted[uid] & set(held)


@settings(max_examples=25, deadline=None)
@given(
    claims=st.lists(st.frozensets(st.integers(0, 7), min_size=1, max_size=3), min_size=2, max_size=12),
    batches=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_overlapping_claims_prepared_concurrently_never_share_a_device(
    claims: list[frozenset[int]], batches: int, seed: int
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        asyncio.run(scenario(claims, batches, seed, Path(directory)))
