"""Topology-aware answer to the kubelet's GetPreferredAllocation.

Pure domain logic: the device-plugin servicer turns the request into these arguments and the
returned IDs into the response; nothing here imports grpclib or the generated protobufs. The
kubelet treats the answer as advice, but an error fails pod admission, so only malformed
requests raise (:class:`AllocationError`, ``INVALID_ARGUMENT``).

Candidates the plugin may not hand out now. The kubelet's available list is its own snapshot: a
GPU handed to DRA or an Xid that landed since can still be in it. Such devices (``usable`` says
no) are dropped from the candidates before choosing, so the answer never prefers them; it then
holds fewer than ``size`` IDs when too few usable ones are left, which the kubelet accepts (it
fills a shortfall itself). Must-include IDs are kept whatever ``usable`` says: the kubelet has
already given them to this container (an init container's devices), a preference cannot take
them back, and an RPC error would fail admission over advice. Allocate is the gate that refuses
an unusable device (``FAILED_PRECONDITION``).

Model. Every device ID (a whole GPU, a MIG device, or a time-slicing replica such as
``<uuid>::3``) belongs to one physical GPU (``gpu_of``). Choosing ``size`` IDs is reduced to
choosing a set S of physical GPUs plus a count per GPU; the IDs within a GPU are its
must-include IDs first, then the rest in natural order (``::2`` before ``::10``). So 8 GPUs x 8
replicas is at most C(8, 4) = 70 candidate GPU sets, never C(64, k) ID combinations.

Objective, compared lexicographically over candidate sets S (every S holds the GPUs of the
must-include IDs):

- ``pack``:   fewest GPUs; best topology score; fewest available IDs on S (best fit, so less
  used GPUs stay whole); GPU order.
- ``spread``: most GPUs; lowest maximum count on any one GPU (balance); best topology score;
  most available IDs on S (least used GPUs); GPU order.

Counts on the chosen S:

- ``spread``: every GPU of S gets at least one ID (its must-include IDs at least), counts rise
  evenly to the lowest level that holds ``size``, and the remainder below that level goes to
  the least used GPUs first (most available IDs; then GPU order).
- ``pack``: the must-include GPUs are filled first, then the other GPUs in order of fewest
  available IDs (the busiest GPU is filled up before a less used one is touched; then GPU order).

For whole GPUs (one ID per GPU) both policies reduce to "the best-scoring set of ``size`` GPUs".

Topology score of S = sum of :meth:`TopologyScorer.pair` over all pairs of distinct GPUs in S,
pair = ``NVLINK_WEIGHT`` x NVLinks + ``PCIE_WEIGHT[level]`` (the scale NVIDIA's go-gpuallocator
uses). One NVLink (>= 110) outweighs any PCIe-only path (<= 60). A pair the link table lacks reads
as SYSTEM, but when both GPUs report the same NUMA node it is scored as NODE.

Search. Exact (every candidate S) while there are at most ``EXACT_MAX_CANDIDATES`` of them, which
covers every node of up to 12 GPUs (C(8, 4) = 70 on 8). Beyond that, a greedy search: from each
seed (the must-include GPUs plus one other GPU), repeatedly add the GPU with the largest summed
pair score to the GPUs already chosen, skipping GPUs after which ``pack`` could no longer reach
``size``; the best seed's set under the full objective wins.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from math import comb
from typing import Literal, NoReturn

from agent.core.inventory.model import Inventory, PcieLevel, link_key
from agent.deviceplugin.errors import AllocationError, ErrorKind, format_ids

ReplicaPolicy = Literal["pack", "spread"]

#: points per NVLink between two GPUs
NVLINK_WEIGHT = 100
#: points for the closest common PCIe ancestor of two GPUs, closer is more
PCIE_WEIGHT: Mapping[PcieLevel, int] = {
    PcieLevel.INTERNAL: 60,
    PcieLevel.SINGLE: 50,
    PcieLevel.MULTIPLE: 40,
    PcieLevel.HOSTBRIDGE: 30,
    PcieLevel.NODE: 20,
    PcieLevel.SYSTEM: 10,
}
#: largest number of candidate GPU sets scored one by one before the greedy search takes over
EXACT_MAX_CANDIDATES = 1024

_DIGITS = re.compile(r"(\d+)")


class TopologyScorer:
    """Pair scores of one inventory's GPUs, computed once.

    Build one per inventory (a new inventory is a new object) and pass it to every
    :func:`preferred_allocation` call for that inventory.
    """

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        gpus = sorted(inventory.gpus, key=lambda g: g.index)
        self._position = {g.uuid: pos for pos, g in enumerate(gpus)}
        self._numa = {g.uuid: g.numa_node for g in gpus}
        self._pairs = {link_key(a.uuid, b.uuid): self._compute(a.uuid, b.uuid) for a, b in combinations(gpus, 2)}

    def pair(self, a: str, b: str) -> int:
        """Score of two physical GPUs (UUIDs); 0 for a GPU with itself."""
        if a == b:
            return 0
        score = self._pairs.get(link_key(a, b))
        return self._compute(a, b) if score is None else score

    def order_key(self, uuid: str) -> tuple[int, str]:
        """GPU order for tie-breaks: inventory index, GPUs unknown to the inventory last."""
        return (self._position.get(uuid, len(self._position)), uuid)

    def _compute(self, a: str, b: str) -> int:
        link = self.inventory.link(a, b)
        level = link.pcie
        numa_a, numa_b = self._numa.get(a), self._numa.get(b)
        if level is PcieLevel.SYSTEM and numa_a is not None and numa_a == numa_b:
            level = PcieLevel.NODE
        return NVLINK_WEIGHT * link.nvlinks + PCIE_WEIGHT[level]


def preferred_allocation(
    *,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    gpu_of: Mapping[str, str],
    inventory: Inventory,
    replica_policy: ReplicaPolicy = "spread",
    scorer: TopologyScorer | None = None,
    usable: Callable[[str], bool] = lambda _: True,
) -> list[str]:
    """The ``size`` device IDs to prefer (fewer when too few are usable), natural-sorted.

    ``gpu_of`` maps every device ID to its physical GPU's UUID (a GPU to itself, a MIG device to
    its parent, a replica to the GPU it shares). ``scorer``, when built for ``inventory``, saves
    recomputing the pair scores. ``usable`` says whether a device may be handed out now; see the
    module docstring for what happens to those it refuses. Raises :class:`AllocationError`
    (``INVALID_ARGUMENT``) for a malformed request; never for a well-formed one.
    """
    _validate(available, must_include, size, gpu_of)
    must = set(must_include)
    candidates = [d for d in available if d in must or usable(d)]
    size = min(size, len(candidates))
    if scorer is None or scorer.inventory is not inventory:
        scorer = TopologyScorer(inventory)
    if size == len(candidates):
        return sorted(candidates, key=natural_key)
    problem = _Problem.build(candidates, must_include, size, gpu_of, scorer)
    chosen = problem.best_set(replica_policy)
    counts = problem.spread_counts(chosen) if replica_policy == "spread" else problem.pack_counts(chosen)
    picked = [dev for i, count in zip(chosen, counts, strict=True) for dev in problem.ids[i][:count]]
    return sorted(picked, key=natural_key)


def natural_key(device_id: str) -> tuple[str | int, ...]:
    """Sort key that orders digit runs by value: ``gpu::2`` before ``gpu::10``."""
    return tuple(int(part) if i % 2 else part for i, part in enumerate(_DIGITS.split(device_id)))


def _validate(available: Sequence[str], must_include: Sequence[str], size: int, gpu_of: Mapping[str, str]) -> None:
    if size <= 0:
        _invalid(f"allocation size must be positive, got {size}", ())
    for label, ids in (("available", available), ("must-include", must_include)):
        dups = sorted(d for d, n in Counter(ids).items() if n > 1)
        if dups:
            _invalid(f"duplicate {label} device IDs: {format_ids(dups)}", dups)
    avail = set(available)
    missing = [d for d in must_include if d not in avail]
    if missing:
        _invalid(f"must-include device IDs are not available: {format_ids(missing)}", missing)
    unknown = [d for d in available if d not in gpu_of]
    if unknown:
        _invalid(f"unknown device IDs (no physical GPU): {format_ids(unknown)}", unknown)
    if size > len(available):
        _invalid(f"allocation size {size} exceeds the {len(available)} available devices", ())
    if len(must_include) > size:
        _invalid(
            f"{len(must_include)} must-include devices exceed allocation size {size}: {format_ids(must_include)}",
            must_include,
        )


def _invalid(message: str, ids: Sequence[str]) -> NoReturn:
    raise AllocationError(ErrorKind.INVALID_ARGUMENT, f"preferred allocation: {message}", tuple(ids))


@dataclass(frozen=True, slots=True)
class _Problem:
    """One request grouped by physical GPU; GPUs are referred to by position in ``ids``."""

    size: int
    ids: list[list[str]]  # per GPU: must-include IDs, then the others, each natural-sorted
    must: list[int]  # per GPU: must-include count
    avail: list[int]  # per GPU: available count (must-include included)
    score: list[list[int]]  # pair score matrix

    @classmethod
    def build(
        cls,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        gpu_of: Mapping[str, str],
        scorer: TopologyScorer,
    ) -> _Problem:
        must_set = set(must_include)
        groups: dict[str, tuple[list[str], list[str]]] = {}
        for dev in available:
            required, rest = groups.setdefault(gpu_of[dev], ([], []))
            (required if dev in must_set else rest).append(dev)
        uuids = sorted(groups, key=scorer.order_key)
        ids = [sorted(groups[u][0], key=natural_key) + sorted(groups[u][1], key=natural_key) for u in uuids]
        return cls(
            size=size,
            ids=ids,
            must=[len(groups[u][0]) for u in uuids],
            avail=[len(i) for i in ids],
            score=[[scorer.pair(a, b) for b in uuids] for a in uuids],
        )

    def best_set(self, policy: ReplicaPolicy) -> tuple[int, ...]:
        required = tuple(i for i, m in enumerate(self.must) if m)
        free = [i for i, m in enumerate(self.must) if not m]
        if policy == "spread":
            extra = min(self.size - sum(self.must), len(free))
        else:
            extra = _fewest_to_cover(self.size - sum(self.avail[i] for i in required), [self.avail[i] for i in free])
        if comb(len(free), extra) <= EXACT_MAX_CANDIDATES:
            candidates: Iterator[tuple[int, ...]] = (required + c for c in combinations(free, extra))
        else:
            candidates = self._greedy_sets(required, free, extra, policy)
        best: tuple[int, ...] = ()
        best_key: tuple[int, ...] | None = None
        for cand in candidates:
            key = self._key(tuple(sorted(cand)), policy)
            if key is not None and (best_key is None or key > best_key):
                best, best_key = tuple(sorted(cand)), key
        return best

    def _key(self, gpus: tuple[int, ...], policy: ReplicaPolicy) -> tuple[int, ...] | None:
        """Larger is better; None when ``pack`` cannot fit ``size`` on ``gpus``."""
        capacity = sum(self.avail[i] for i in gpus)
        topo = sum(self.score[a][b] for a, b in combinations(gpus, 2))
        if policy == "pack":
            return None if capacity < self.size else (topo, -capacity)
        return (-self._max_load(gpus), topo, capacity)

    def _level(self, gpus: Sequence[int]) -> int:
        """Smallest water level L with sum(clamp(L, lower, avail)) >= size (spread's fill)."""
        lo, hi = 0, max(self.avail[i] for i in gpus)
        while lo < hi:
            mid = (lo + hi) // 2
            if sum(min(max(mid, self.must[i], 1), self.avail[i]) for i in gpus) >= self.size:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _max_load(self, gpus: tuple[int, ...]) -> int:
        return max(self._level(gpus), *(max(self.must[i], 1) for i in gpus))

    def spread_counts(self, gpus: tuple[int, ...]) -> list[int]:
        """Balanced counts: every GPU at least one, the remainder to the least used GPUs."""
        level = self._level(gpus)
        counts = [min(max(level - 1, self.must[i], 1), self.avail[i]) for i in gpus]
        left = self.size - sum(counts)
        for pos in sorted(range(len(gpus)), key=lambda p: (-self.avail[gpus[p]], gpus[p])):
            if left and counts[pos] < min(max(level, self.must[gpus[pos]], 1), self.avail[gpus[pos]]):
                counts[pos] += 1
                left -= 1
        return counts

    def pack_counts(self, gpus: tuple[int, ...]) -> list[int]:
        """Fill the must-include GPUs first, then the GPUs with the fewest available IDs."""
        counts = [self.must[i] for i in gpus]
        left = self.size - sum(counts)
        for pos in sorted(range(len(gpus)), key=lambda p: (not self.must[gpus[p]], self.avail[gpus[p]], gpus[p])):
            take = min(self.avail[gpus[pos]] - counts[pos], left)
            counts[pos] += take
            left -= take
        return counts

    def _greedy_sets(
        self, required: tuple[int, ...], free: list[int], extra: int, policy: ReplicaPolicy
    ) -> Iterator[tuple[int, ...]]:
        """Heuristic candidates for large nodes; see the module docstring."""
        # the highest-capacity choice always fits, so pack has at least one feasible candidate
        yield required + tuple(sorted(free, key=lambda i: (-self.avail[i], i))[:extra])
        for seed in free:
            chosen = [*required, seed]
            rest = [i for i in free if i != seed]
            gain = {i: sum(self.score[i][c] for c in chosen) for i in rest}
            capacity = sum(self.avail[i] for i in chosen)
            while len(chosen) < len(required) + extra:
                slots = len(required) + extra - len(chosen) - 1
                fits = [i for i in rest if policy == "spread" or self._can_fill(capacity, i, rest, slots)]
                if not fits:
                    break
                pick = max(fits, key=lambda i: (gain[i], -i))
                chosen.append(pick)
                rest.remove(pick)
                capacity += self.avail[pick]
                for i in rest:
                    gain[i] += self.score[i][pick]
            else:
                yield tuple(chosen)

    def _can_fill(self, capacity: int, pick: int, rest: list[int], slots: int) -> bool:
        """Whether adding ``pick`` and then the ``slots`` largest others can still hold ``size``."""
        others = sorted((self.avail[i] for i in rest if i != pick), reverse=True)
        return capacity + self.avail[pick] + sum(others[:slots]) >= self.size


def _fewest_to_cover(need: int, capacities: list[int]) -> int:
    """How many of ``capacities`` (largest first) it takes to reach ``need``."""
    taken = 0
    for cap in sorted(capacities, reverse=True):
        if need <= 0:
            break
        need -= cap
        taken += 1
    return taken
