"""GetPreferredAllocation domain logic: known answers, invariants, optimality, replicas, errors."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from itertools import combinations
from math import comb

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.inventory.model import Gpu, Inventory, Link, MigDevice, PcieLevel, link_key
from agent.deviceplugin.errors import AllocationError, ErrorKind
from agent.deviceplugin.preferred import (
    EXACT_MAX_CANDIDATES,
    NVLINK_WEIGHT,
    PCIE_WEIGHT,
    ReplicaPolicy,
    TopologyScorer,
    natural_key,
    preferred_allocation,
)

PROPS = settings(max_examples=200, deadline=None)


def uuid(i: int) -> str:
    return f"GPU-{i:02d}"


def make_inventory(numa: Sequence[int | None], link: Callable[[int, int], Link | None]) -> Inventory:
    """A node of ``len(numa)`` GPUs; ``link(i, j)`` (i < j) gives the pair's link, None leaves it out."""
    gpus = tuple(
        Gpu(
            uuid=uuid(i),
            index=i,
            minor=i,
            product_name="NVIDIA H100 80GB HBM3",
            architecture="hopper",
            compute_capability="9.0",
            memory_mib=81559,
            pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0",
            numa_node=n,
        )
        for i, n in enumerate(numa)
    )
    links: dict[tuple[str, str], Link] = {}
    for i, j in combinations(range(len(numa)), 2):
        found = link(i, j)
        if found is not None:
            links[link_key(uuid(i), uuid(j))] = found
    return Inventory(backend="test", driver_version="550.54", cuda_driver_version="12.4", gpus=gpus, links=links)


def _same_half(i: int, j: int) -> bool:
    return i // 4 == j // 4


# NVSwitch node: every pair NV18; PCIe says NODE inside a socket (GPUs 0-3, 4-7), SYSTEM across.
NVLINK8 = make_inventory(
    [0, 0, 0, 0, 1, 1, 1, 1],
    lambda i, j: Link(18, PcieLevel.NODE if _same_half(i, j) else PcieLevel.SYSTEM),
)
# Two NVLink islands (0-3, 4-7) of NV4; GPU pairs 0-1, 2-3, 4-5, 6-7 share a PCIe switch;
# cross-island pairs are absent from the link table (read as SYSTEM, different NUMA nodes).
ISLANDS = make_inventory(
    [0, 0, 0, 0, 1, 1, 1, 1],
    lambda i, j: Link(4, PcieLevel.SINGLE if i // 2 == j // 2 else PcieLevel.NODE) if _same_half(i, j) else None,
)
PCIE2 = make_inventory([0, 0], lambda i, j: Link(0, PcieLevel.HOSTBRIDGE))
# Four PCIe GPUs, no link table: only NUMA (0, 0, 1, 1) tells pairs apart.
PCIE4_NUMA = make_inventory([0, 0, 1, 1], lambda i, j: None)
PRESETS = {"nvlink8": NVLINK8, "islands": ISLANDS, "pcie2": PCIE2, "pcie4": PCIE4_NUMA}


def whole(inventory: Inventory) -> dict[str, str]:
    return {g.uuid: g.uuid for g in inventory.gpus}


def replicas(inventory: Inventory, per_gpu: int) -> dict[str, str]:
    return {f"{g.uuid}::{r}": g.uuid for g in inventory.gpus for r in range(per_gpu)}


def choose(
    inventory: Inventory,
    available: Sequence[str],
    size: int,
    must: Sequence[str] = (),
    gpu_of: dict[str, str] | None = None,
    policy: ReplicaPolicy = "spread",
) -> list[str]:
    return preferred_allocation(
        available=available,
        must_include=must,
        size=size,
        gpu_of=whole(inventory) if gpu_of is None else gpu_of,
        inventory=inventory,
        replica_policy=policy,
    )


def reference_pair(inventory: Inventory, a: str, b: str) -> int:
    """The documented weights, recomputed here independently of TopologyScorer."""
    link = inventory.link(a, b)
    level = link.pcie
    numa = {g.uuid: g.numa_node for g in inventory.gpus}
    if level == PcieLevel.SYSTEM and numa.get(a) is not None and numa.get(a) == numa.get(b):
        level = PcieLevel.NODE
    return NVLINK_WEIGHT * link.nvlinks + PCIE_WEIGHT[level]


def reference_score(inventory: Inventory, gpus: Sequence[str]) -> int:
    return sum(reference_pair(inventory, a, b) for a, b in combinations(sorted(set(gpus)), 2))


# --- scoring --------------------------------------------------------------------------------


def test_weights_order_interconnects() -> None:
    nvlink = NVLINK_WEIGHT + PCIE_WEIGHT[PcieLevel.SYSTEM]
    switch = [PCIE_WEIGHT[lv] for lv in (PcieLevel.INTERNAL, PcieLevel.SINGLE, PcieLevel.MULTIPLE)]
    bridge = [PCIE_WEIGHT[lv] for lv in (PcieLevel.HOSTBRIDGE, PcieLevel.NODE)]
    assert nvlink > max(switch)
    assert min(switch) > max(bridge)
    assert min(bridge) > PCIE_WEIGHT[PcieLevel.SYSTEM]


@pytest.mark.parametrize(
    ("inventory", "a", "b", "expected"),
    [
        (NVLINK8, 0, 1, 18 * 100 + 20),
        (NVLINK8, 0, 7, 18 * 100 + 10),
        (ISLANDS, 0, 1, 4 * 100 + 50),
        (ISLANDS, 0, 2, 4 * 100 + 20),
        (ISLANDS, 3, 4, 10),
        (PCIE2, 0, 1, 30),
        (PCIE4_NUMA, 0, 1, 20),  # missing from the table, same NUMA node: NODE
        (PCIE4_NUMA, 1, 2, 10),
        (PCIE4_NUMA, 2, 2, 0),
    ],
)
def test_pair_scores(inventory: Inventory, a: int, b: int, expected: int) -> None:
    assert TopologyScorer(inventory).pair(uuid(a), uuid(b)) == expected


# --- known answers, whole GPUs --------------------------------------------------------------


def ids(*indexes: int) -> list[str]:
    return [uuid(i) for i in indexes]


@pytest.mark.parametrize(
    ("inventory", "available", "size", "must", "expected"),
    [
        (ISLANDS, ids(*range(8)), 4, [], ids(0, 1, 2, 3)),
        (ISLANDS, ids(*range(8)), 4, ids(5), ids(4, 5, 6, 7)),
        (ISLANDS, ids(*range(8)), 2, [], ids(0, 1)),  # NVLink and the same PCIe switch
        (ISLANDS, ids(*range(8)), 2, ids(6), ids(6, 7)),
        (ISLANDS, ids(0, 1, 4, 5, 6), 3, [], ids(4, 5, 6)),
        (ISLANDS, ids(*range(8)), 5, ids(7), ids(0, 1, 2, 3, 7)),  # either island + GPU-07 ties: GPU order
        (ISLANDS, ids(*range(8)), 5, ids(6, 7), ids(0, 4, 5, 6, 7)),
        (ISLANDS, ids(0, 2, 5, 7), 2, ids(0), ids(0, 2)),
        (ISLANDS, ids(*range(8)), 8, ids(3), ids(*range(8))),
        (NVLINK8, ids(*range(8)), 4, [], ids(0, 1, 2, 3)),
        (NVLINK8, ids(*range(8)), 4, ids(6), ids(4, 5, 6, 7)),
        (NVLINK8, ids(*range(8)), 1, [], ids(0)),
        (PCIE2, ids(0, 1), 1, [], ids(0)),
        (PCIE2, ids(0, 1), 1, ids(1), ids(1)),
        (PCIE2, ids(0, 1), 2, [], ids(0, 1)),
        (PCIE4_NUMA, ids(0, 2, 3), 2, [], ids(2, 3)),  # same NUMA beats cross-socket
        (PCIE4_NUMA, ids(1, 2, 3), 2, ids(1), ids(1, 2)),  # forced across; GPU order breaks the tie
    ],
)
def test_known_answers(
    inventory: Inventory, available: list[str], size: int, must: list[str], expected: list[str]
) -> None:
    for policy in ("pack", "spread"):
        assert choose(inventory, available, size, must, policy=policy) == expected


def test_devices_unknown_to_inventory_score_as_cross_socket() -> None:
    gpu_of = {"a": "GPU-XX", "b": "GPU-00", "c": "GPU-01"}
    assert choose(ISLANDS, ["a", "b", "c"], 2, gpu_of=gpu_of) == ["b", "c"]


def test_reused_scorer_gives_same_answer() -> None:
    scorer = TopologyScorer(ISLANDS)
    got = preferred_allocation(
        available=ids(*range(8)), must_include=ids(5), size=3, gpu_of=whole(ISLANDS), inventory=ISLANDS, scorer=scorer
    )
    assert got == choose(ISLANDS, ids(*range(8)), 3, ids(5)) == ids(4, 5, 6)


# --- replicas and MIG -----------------------------------------------------------------------


def per_gpu(result: Sequence[str], gpu_of: dict[str, str]) -> dict[str, int]:
    return dict(sorted(Counter(gpu_of[d] for d in result).items()))


R4 = replicas(ISLANDS, 4)


@pytest.mark.parametrize(
    ("size", "must", "policy", "expected"),
    [
        (4, [], "spread", {uuid(i): 1 for i in range(4)}),
        (4, [], "pack", {uuid(0): 4}),
        (6, [], "pack", {uuid(0): 4, uuid(1): 2}),  # two GPUs, the best pair
        (6, [], "spread", {uuid(i): 1 for i in range(6)}),
        (10, [], "spread", {**{uuid(i): 1 for i in range(8)}, uuid(0): 2, uuid(1): 2}),
        (32, [], "spread", {uuid(i): 4 for i in range(8)}),
        (3, ["GPU-05::2", "GPU-05::3"], "spread", {uuid(4): 1, uuid(5): 2}),
        (3, ["GPU-05::2"], "pack", {uuid(5): 3}),
        (5, ["GPU-05::2", "GPU-06::0"], "pack", {uuid(5): 4, uuid(6): 1}),
        (2, ["GPU-07::1"], "spread", {uuid(6): 1, uuid(7): 1}),
    ],
)
def test_replica_policies(size: int, must: list[str], policy: ReplicaPolicy, expected: dict[str, int]) -> None:
    result = choose(ISLANDS, sorted(R4), size, must, gpu_of=R4, policy=policy)
    assert per_gpu(result, R4) == expected
    assert set(must) <= set(result)


def test_replicas_within_a_gpu_are_taken_in_natural_order() -> None:
    gpu_of = replicas(PCIE2, 12)
    result = choose(PCIE2, sorted(gpu_of), 3, gpu_of=gpu_of, policy="pack")
    assert result == ["GPU-00::0", "GPU-00::1", "GPU-00::2"]
    result = choose(PCIE2, sorted(gpu_of), 3, ["GPU-00::11"], gpu_of=gpu_of, policy="pack")
    assert result == ["GPU-00::0", "GPU-00::1", "GPU-00::11"]


def test_pack_prefers_the_fullest_gpu_that_fits() -> None:
    available = ["GPU-00::0", "GPU-00::1", "GPU-00::2", "GPU-01::3"]
    assert choose(PCIE2, available, 1, gpu_of=replicas(PCIE2, 4), policy="pack") == ["GPU-01::3"]


def test_spread_prefers_the_least_used_gpu() -> None:
    available = ["GPU-00::3", "GPU-01::0", "GPU-01::1", "GPU-01::2"]
    assert choose(PCIE2, available, 1, gpu_of=replicas(PCIE2, 4)) == ["GPU-01::0"]


@pytest.mark.parametrize(
    ("inventory", "available", "size", "expected"),
    [
        # two GPUs, 4 and 2 IDs free: 3 IDs means one GPU gets two, and that is the less used one
        (PCIE2, ["GPU-00::0", "GPU-00::1", "GPU-00::2", "GPU-00::3", "GPU-01::2", "GPU-01::3"], 3, [2, 1]),
        # 4, 3, 2 and 4 free: the level is 2; the two units above level 1 go to GPUs 0 and 3
        (PCIE4_NUMA, [f"GPU-{g:02d}::{r}" for g, n in enumerate((4, 3, 2, 4)) for r in range(n)], 6, [2, 1, 1, 2]),
        # equally used GPUs: GPU order decides
        (PCIE4_NUMA, [f"GPU-{g:02d}::{r}" for g in range(4) for r in range(3)], 6, [2, 2, 1, 1]),
    ],
)
def test_spread_gives_the_remainder_to_the_least_used_gpus(
    inventory: Inventory, available: list[str], size: int, expected: list[int]
) -> None:
    gpu_of = replicas(inventory, 4)
    result = choose(inventory, available, size, gpu_of=gpu_of)
    assert per_gpu(result, gpu_of) == {uuid(i): n for i, n in enumerate(expected)}


@pytest.mark.parametrize(
    ("available", "size", "must", "expected"),
    [
        # neither GPU holds 5 alone: the busier one (2 free) is filled up first, the rest from the other
        (["GPU-00::0", "GPU-00::1", "GPU-00::2", "GPU-00::3", "GPU-01::0", "GPU-01::1"], 5, [], [3, 2]),
        # a must-include GPU is filled first, even when it is the less used one
        (["GPU-00::0", "GPU-00::1", "GPU-00::2", "GPU-00::3", "GPU-01::0", "GPU-01::1"], 5, ["GPU-00::3"], [4, 1]),
        # equally used: GPU order decides
        (["GPU-00::0", "GPU-00::1", "GPU-01::0", "GPU-01::1"], 3, [], [2, 1]),
    ],
)
def test_pack_fills_the_busiest_gpu_first(
    available: list[str], size: int, must: list[str], expected: list[int]
) -> None:
    gpu_of = replicas(PCIE2, 4)
    result = choose(PCIE2, available, size, must, gpu_of=gpu_of, policy="pack")
    assert per_gpu(result, gpu_of) == {uuid(i): n for i, n in enumerate(expected)}


def test_spread_balances_around_a_nearly_full_gpu() -> None:
    gpu_of = replicas(PCIE4_NUMA, 4)
    available = ["GPU-00::2", *(d for d in sorted(gpu_of) if not d.startswith(uuid(0)))]
    result = choose(PCIE4_NUMA, available, 9, gpu_of=gpu_of)
    assert per_gpu(result, gpu_of) == {uuid(0): 1, uuid(1): 3, uuid(2): 3, uuid(3): 2}


def test_mig_devices_use_their_parent_topology() -> None:
    def mig(parent: int, n: int) -> MigDevice:
        return MigDevice(
            uuid=f"MIG-{parent}-{n}",
            parent_uuid=uuid(parent),
            index=n,
            gpu_instance_id=n,
            compute_instance_id=0,
            profile="3g.40gb",
            memory_mib=40192,
        )

    migs = [mig(p, n) for p in (0, 2, 4, 5) for n in (0, 1)]
    gpu_of = {m.uuid: m.parent_uuid for m in migs}
    available = [m.uuid for m in migs]
    # 4-5 share NVLink and a PCIe switch; 0-2 only NVLink plus NODE
    assert choose(ISLANDS, available, 2, gpu_of=gpu_of) == ["MIG-4-0", "MIG-5-0"]
    assert choose(ISLANDS, available, 2, gpu_of=gpu_of, policy="pack") == ["MIG-0-0", "MIG-0-1"]
    assert choose(ISLANDS, available, 2, ["MIG-2-1"], gpu_of=gpu_of) == ["MIG-0-0", "MIG-2-1"]


# --- properties -----------------------------------------------------------------------------


@st.composite
def requests(draw: st.DrawFn, per_gpu_max: int) -> tuple[Inventory, dict[str, str], list[str], list[str], int]:
    inventory = PRESETS[draw(st.sampled_from(sorted(PRESETS)))]
    gpu_of = replicas(inventory, draw(st.integers(1, per_gpu_max))) if per_gpu_max > 1 else whole(inventory)
    available = draw(st.lists(st.sampled_from(sorted(gpu_of)), min_size=1, unique=True, max_size=len(gpu_of)))
    size = draw(st.integers(1, len(available)))
    must = draw(st.lists(st.sampled_from(available), unique=True, max_size=size))
    return inventory, gpu_of, available, must, size


def check_invariants(result: list[str], available: list[str], must: list[str], size: int) -> None:
    assert len(result) == size
    assert len(set(result)) == size
    assert set(must) <= set(result)
    assert set(result) <= set(available)
    assert result == sorted(result, key=natural_key)


@PROPS
@given(req=requests(per_gpu_max=1), policy=st.sampled_from(["pack", "spread"]), data=st.data())
def test_whole_gpus_are_valid_and_optimal(
    req: tuple[Inventory, dict[str, str], list[str], list[str], int], policy: ReplicaPolicy, data: st.DataObject
) -> None:
    inventory, gpu_of, available, must, size = req
    result = choose(inventory, available, size, must, gpu_of=gpu_of, policy=policy)
    check_invariants(result, available, must, size)
    others = [d for d in available if d not in must]
    best = max(reference_score(inventory, [*must, *c]) for c in combinations(others, size - len(must)))
    assert reference_score(inventory, result) == best
    shuffled = data.draw(st.permutations(available))
    assert choose(inventory, shuffled, size, list(reversed(must)), gpu_of=gpu_of, policy=policy) == result


def _fill_bounds(gpus: Sequence[str], avail: Counter[str], must: Counter[str], size: int) -> tuple[bool, int]:
    """Whether ``size`` fits on ``gpus`` with one device each at least, and the lowest max count."""
    lower = {g: max(must[g], 1) for g in gpus}
    if sum(lower.values()) > size or sum(avail[g] for g in gpus) < size:
        return False, 0
    level = max(lower.values())
    while sum(min(max(level, lower[g]), avail[g]) for g in gpus) < size:
        level += 1
    return True, level


@PROPS
@given(req=requests(per_gpu_max=8), policy=st.sampled_from(["pack", "spread"]), data=st.data())
def test_replicas_are_valid_and_follow_the_policy(
    req: tuple[Inventory, dict[str, str], list[str], list[str], int], policy: ReplicaPolicy, data: st.DataObject
) -> None:
    inventory, gpu_of, available, must, size = req
    result = choose(inventory, available, size, must, gpu_of=gpu_of, policy=policy)
    check_invariants(result, available, must, size)
    shuffled = data.draw(st.permutations(available))
    assert choose(inventory, shuffled, size, list(reversed(must)), gpu_of=gpu_of, policy=policy) == result

    avail = Counter(gpu_of[d] for d in available)
    need = Counter(gpu_of[d] for d in must)
    counts = per_gpu(result, gpu_of)
    # brute force over GPU sets: (number of GPUs, balance, topology), by the policy's priorities
    options = []
    for k in range(1, len(avail) + 1):
        for gpus in combinations(sorted(avail), k):
            if not set(need) <= set(gpus):
                continue
            fits, max_load = _fill_bounds(gpus, avail, need, size)
            if fits:
                options.append((k, max_load, reference_score(inventory, gpus)))
    if policy == "pack":
        best = max((-k, score) for k, _, score in options)
        assert (-len(counts), reference_score(inventory, list(counts))) == best
    else:
        best_spread = max((k, -load, score) for k, load, score in options)
        got = (len(counts), -max(counts.values()), reference_score(inventory, list(counts)))
        assert got == best_spread
    check_count_rule(policy, counts, avail, need)


def check_count_rule(policy: ReplicaPolicy, counts: dict[str, int], avail: Counter[str], need: Counter[str]) -> None:
    """How IDs are spread over the chosen GPUs (the module docstring's "Counts on the chosen S").

    spread: no GPU holds a remainder unit (one above its forced minimum and one above another
    GPU) while a less used GPU (more free IDs; GPU order on a tie) below it could have taken it.
    pack: no GPU gets more than its must-include IDs while a GPU earlier in fill order (must-include
    GPUs, then fewest free IDs, then GPU order) still has free IDs.
    """
    for a, b in combinations(sorted(counts), 2):
        for g, h in ((a, b), (b, a)):
            if policy == "spread":
                less_used_first = (-avail[h], h) < (-avail[g], g)
                took_remainder = counts[g] == counts[h] + 1 and counts[g] > max(need[g], 1)
                assert not (less_used_first and took_remainder and counts[h] < avail[h]), (g, h, counts)
            else:
                fills_first = (need[g] == 0, avail[g], g) < (need[h] == 0, avail[h], h)
                assert not (fills_first and counts[h] > need[h] and counts[g] < avail[g]), (g, h, counts)


# 16 GPUs in four NVLink islands of four: past EXACT_MAX_CANDIDATES, the greedy search runs.
ISLANDS16 = make_inventory(
    [i // 8 for i in range(16)], lambda i, j: Link(4, PcieLevel.NODE) if i // 4 == j // 4 else None
)


def test_large_node_uses_greedy_and_still_finds_islands() -> None:
    assert comb(16, 8) > EXACT_MAX_CANDIDATES
    assert choose(ISLANDS16, ids(*range(16)), 8) == ids(*range(8))
    assert choose(ISLANDS16, ids(*range(16)), 8, ids(9, 14)) == ids(*range(8, 16))
    gpu_of = replicas(ISLANDS16, 2)
    packed = choose(ISLANDS16, sorted(gpu_of), 16, ["GPU-13::1"], gpu_of=gpu_of, policy="pack")
    assert per_gpu(packed, gpu_of) == {uuid(i): 2 for i in range(8, 16)}  # same NUMA node


@PROPS
@given(data=st.data(), policy=st.sampled_from(["pack", "spread"]), per=st.integers(1, 3))
def test_large_node_requests_are_valid(data: st.DataObject, policy: ReplicaPolicy, per: int) -> None:
    gpu_of = replicas(ISLANDS16, per) if per > 1 else whole(ISLANDS16)
    # mostly-free nodes, so that most draws exceed EXACT_MAX_CANDIDATES
    pool = sorted(gpu_of)
    available = data.draw(st.lists(st.sampled_from(pool), min_size=len(pool) * 3 // 4, unique=True, max_size=len(pool)))
    size = data.draw(st.integers(1, len(available)))
    must = data.draw(st.lists(st.sampled_from(available), unique=True, max_size=min(size, 3)))
    result = choose(ISLANDS16, available, size, must, gpu_of=gpu_of, policy=policy)
    check_invariants(result, available, must, size)


# --- devices the plugin may not hand out now ---------------------------------------------


def test_unusable_candidates_are_dropped() -> None:
    everything = ids(*range(8))
    # 0-1 would be the best pair (NVLink and one PCIe switch); GPU-01 is out, so the next such pair
    assert preferred_allocation(
        available=everything, must_include=[], size=2, gpu_of=whole(ISLANDS), inventory=ISLANDS,
        usable=lambda d: d != uuid(1),
    ) == ids(2, 3)  # fmt: skip


@pytest.mark.parametrize(
    ("available", "must", "size", "unusable", "expected"),
    [
        (ids(0, 1), ids(1), 2, ids(1), ids(0, 1)),  # must-include is kept whatever its state
        (ids(0, 1, 2), [], 3, ids(2), ids(0, 1)),  # too few usable: fewer than asked
        (ids(0, 1, 2), ids(2), 3, ids(1, 2), ids(0, 2)),
        (ids(0), [], 1, ids(0), []),  # nothing usable: an empty preference, not an error
    ],
)
def test_too_few_usable_candidates_give_a_shorter_answer(
    available: list[str], must: list[str], size: int, unusable: list[str], expected: list[str]
) -> None:
    result = preferred_allocation(
        available=available,
        must_include=must,
        size=size,
        gpu_of=whole(ISLANDS),
        inventory=ISLANDS,
        usable=lambda d: d not in unusable,
    )
    assert result == expected


@PROPS
@given(req=requests(per_gpu_max=4), policy=st.sampled_from(["pack", "spread"]), data=st.data())
def test_unusable_devices_are_never_preferred(
    req: tuple[Inventory, dict[str, str], list[str], list[str], int], policy: ReplicaPolicy, data: st.DataObject
) -> None:
    inventory, gpu_of, available, must, size = req
    unusable = set(data.draw(st.lists(st.sampled_from(available), unique=True)))
    result = preferred_allocation(
        available=available,
        must_include=must,
        size=size,
        gpu_of=gpu_of,
        inventory=inventory,
        replica_policy=policy,
        usable=lambda d: d not in unusable,
    )
    usable_count = len([d for d in available if d not in unusable or d in must])
    assert len(result) == min(size, usable_count)
    assert set(must) <= set(result) <= set(available)
    assert not (set(result) - set(must)) & unusable


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("available", "must", "size", "named"),
    [
        (ids(0, 1), [], 0, ()),
        (ids(0, 1), [], -1, ()),
        (ids(0, 1), [], 3, ()),
        (ids(0, 1), ids(2), 1, ids(2)),
        (ids(0, 1), ids(0, 1), 1, ids(0, 1)),
        ([*ids(0, 1), uuid(1)], [], 1, ids(1)),
        (ids(0, 1), ids(0, 0), 2, ids(0)),
        ([*ids(0, 1), "GPU-99"], [], 1, ["GPU-99"]),
    ],
    ids=["zero", "negative", "too-many", "must-missing", "must-over-size", "dup-available", "dup-must", "unknown"],
)
def test_bad_requests_are_invalid_arguments(
    available: list[str], must: list[str], size: int, named: Sequence[str]
) -> None:
    with pytest.raises(AllocationError) as err:
        choose(PCIE2, available, size, must)
    assert err.value.kind is ErrorKind.INVALID_ARGUMENT
    assert err.value.device_ids == tuple(named)
    for device in named:
        assert device in str(err.value)
