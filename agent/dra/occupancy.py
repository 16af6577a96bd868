"""What each GPU's MIG partitions and shares hold, and what is still free. Pure.

:func:`occupancy` is what ``/debug/state`` (``devices[].dra``), ``gpu-agent status`` and the
``gpu_agent_dra_*`` partition metrics show per GPU: its publish mode, the MIG instances made for
claims (profile, placement, instance UUID, claim), the shares prepared on it (memory, share ID,
claim), and the free part of its counters (memory slices not taken, instances left of limited
profiles) or of its shared memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.core.inventory.model import Inventory
from agent.dra.claims.checkpoint import PreparedClaim
from agent.dra.devices import DraDevice, binary_quantity
from agent.dra.modes import GpuMode
from agent.dra.partitions import CounterSet, counter_set_name


@dataclass(frozen=True, slots=True)
class Occupancy:
    mode: GpuMode | None
    partitions: tuple[dict[str, object], ...] = ()
    shares: tuple[dict[str, object], ...] = ()
    #: counter name -> what is left of it (dynamic-mig)
    free_counters: Mapping[str, int] = field(default_factory=dict)
    #: shared: bytes of memory no share holds (None when the GPU is not shared)
    free_memory: int | None = None
    memory: int | None = None

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "publish": self.mode.as_dict() if self.mode is not None else None,
            "partitions": list(self.partitions),
            "shares": list(self.shares),
        }
        if self.free_counters:
            out["free_counters"] = dict(self.free_counters)
        if self.free_memory is not None and self.memory is not None:
            out["shared_memory"] = {
                "capacity": binary_quantity(self.memory),
                "allocated": binary_quantity(self.memory - self.free_memory),
                "free": binary_quantity(self.free_memory),
                "free_bytes": self.free_memory,
            }
        return out


def occupancy(
    inventory: Inventory,
    *,
    modes: Mapping[str, GpuMode],
    devices: Mapping[str, DraDevice],
    counter_sets: list[CounterSet],
    claims: Mapping[str, PreparedClaim],
) -> dict[str, Occupancy]:
    """GPU UUID -> what is held and free on it."""
    partitions: dict[str, list[dict[str, object]]] = {}
    shares: dict[str, list[dict[str, object]]] = {}
    taken: dict[str, dict[str, int]] = {}
    for claim in claims.values():
        who = f"{claim.namespace}/{claim.name}" if claim.complete else f"(claim {claim.uid})"
        for d in claim.devices:
            if d.placement is not None:
                published = devices.get(d.name)
                partition = published.partition if published is not None else None
                partitions.setdefault(d.gpu_uuid, []).append(
                    {
                        "device": d.name,
                        "profile": partition.profile if partition is not None else "",
                        "profile_id": d.profile_id,
                        "placement": {"start": d.placement.start, "size": d.placement.size},
                        "mig_uuid": d.uuid,
                        "claim": who,
                        "claim_uid": claim.uid,
                    }
                )
                for use in published.consumes if published is not None else ():
                    for name, value in use.counters:
                        counts = taken.setdefault(use.counter_set, {})
                        counts[name] = counts.get(name, 0) + int(value)
            if d.share_memory is not None:
                shares.setdefault(d.gpu_uuid, []).append(
                    {
                        "device": d.name,
                        "share_id": d.share_id,
                        "memory": binary_quantity(d.share_memory),
                        "memory_bytes": d.share_memory,
                        "mps": d.mps,
                        "claim": who,
                        "claim_uid": claim.uid,
                    }
                )
    sets = {s.name: s for s in counter_sets}
    shared = {d.gpu_uuid: d.share.memory for d in devices.values() if d.share is not None}
    out: dict[str, Occupancy] = {}
    for gpu in inventory.gpus:
        free: dict[str, int] = {}
        counters = sets.get(counter_set_name(gpu))
        if counters is not None:
            used = taken.get(counters.name, {})
            free = {name: int(value) - used.get(name, 0) for name, value in counters.counters}
        held = shares.get(gpu.uuid, [])
        capacity = shared.get(gpu.uuid)
        free_memory = None
        if capacity is not None:
            free_memory = capacity - sum(int(str(s["memory_bytes"])) for s in held)
        out[gpu.uuid] = Occupancy(
            mode=modes.get(gpu.uuid),
            partitions=tuple(partitions.get(gpu.uuid, ())),
            shares=tuple(held),
            free_counters=free,
            free_memory=free_memory,
            memory=capacity,
        )
    return out
