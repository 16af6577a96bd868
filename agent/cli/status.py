"""``gpu-agent status``: the node's GPUs at a glance, from the running agent's ``/debug/state``.

Per GPU: owner (granted, and the desired one when they differ), health, who holds it and how
busy it is. Readable at 80 columns; ``--json`` prints the same rows as JSON for scripts.

UTIL reads ``42%``, ``mig`` (MIG mode: NVML has no utilization counter), ``?`` (the newest
reading is missing or stale: NVML failing or hung) or ``-`` (not sampled). Under a GPU DRA
publishes ``dynamic-mig`` or ``shared``, or one changing mode, a line says so: the MIG instances
made for claims and the memory slices left, or the shares and their memory. Orphaned
allocations and watchdog repairs, when there are any, follow the table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: holders named on a row (the rest are counted)
SHOWN_HOLDERS = 2
#: orphans and watchdog disagreements named under the table (the rest are counted)
SHOWN_NOTES = 3
WIDTH = 80


@dataclass(frozen=True, slots=True)
class StatusRow:
    index: int
    uuid: str
    owner: str
    desired: str
    health: str
    cause: str
    holders: tuple[str, ...]
    #: GPU utilization in percent, None when not sampled (or unknown)
    gpu_percent: float | None
    memory_used_mib: int | None
    memory_total_mib: int | None
    #: True: read and fresh; False: the reading is missing or stale; None: not sampled at all
    utilization_known: bool | None = None
    utilization_reason: str = ""
    mig_enabled: bool = False
    #: what DRA's publish mode says under the row ("" for a GPU published whole, as it always was)
    partitioning: str = ""

    def as_dict(self) -> dict[str, object]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "owner": self.owner,
            "desired_owner": self.desired,
            "health": self.health,
            "health_cause": self.cause,
            "holders": list(self.holders),
            "gpu_utilization_percent": self.gpu_percent,
            "memory_used_mib": self.memory_used_mib,
            "memory_total_mib": self.memory_total_mib,
            "utilization_known": self.utilization_known,
            "utilization_reason": self.utilization_reason,
            "partitioning": self.partitioning,
        }


def rows_from_state(state: Mapping[str, Any]) -> list[StatusRow]:
    rows = []
    for d in state.get("devices") or ():
        holders = []
        for mechanism in (d.get("holders") or {}).values():
            for h in mechanism:
                who = f"{h.get('namespace')}/{h.get('name')}"
                holders.append(f"claim {who}" if h.get("kind") == "claim" else who)
        util = d.get("utilization") or {}
        detail = d.get("health_detail") or {}
        rows.append(
            StatusRow(
                index=int(d.get("index", -1)),
                uuid=str(d.get("uuid", "")),
                owner=str(d.get("owner", "")),
                desired=str(d.get("desired_owner") or d.get("owner", "")),
                health=str(d.get("health", "")),
                cause=str(detail.get("cause", "") if isinstance(detail, dict) else ""),
                holders=tuple(holders),
                gpu_percent=_number(util.get("gpu_percent")),
                memory_used_mib=_int(util.get("memory_used_mib")),
                memory_total_mib=_int(util.get("memory_total_mib")) or _int(d.get("memory_mib")),
                utilization_known=util.get("known") if isinstance(util.get("known"), bool) else None,
                utilization_reason=str(util.get("reason") or ""),
                mig_enabled=d.get("mig_enabled") is True,
                partitioning=_partitioning((d.get("mechanism_details") or {}).get("dra")),
            )
        )
    return sorted(rows, key=lambda r: r.index)


def _partitioning(dra: Any) -> str:
    """One line: the GPU's DRA publish mode, its MIG partitions or shares, what is free."""
    if not isinstance(dra, dict) or not isinstance(dra.get("publish"), dict):
        return ""
    publish = dra["publish"]
    state = str(publish.get("state") or "")
    if state.startswith("changing->"):
        waits = [str(w) for w in publish.get("waiting_for") or ()]
        return f"{state}, waits for {', '.join(waits[:SHOWN_HOLDERS])}" + (" ..." if len(waits) > 2 else "")
    parts = [p for p in dra.get("partitions") or () if isinstance(p, dict)]
    shares = [s for s in dra.get("shares") or () if isinstance(s, dict)]
    if state == "dynamic-mig":
        free = dra.get("free_counters") or {}
        slices = [k for k in free if str(k).startswith("memory-slice-")]
        left = sum(1 for k in slices if free[k])
        held = ", ".join(f"{p.get('profile')} {p.get('claim')}" for p in parts[:SHOWN_HOLDERS])
        more = f" +{len(parts) - SHOWN_HOLDERS}" if len(parts) > SHOWN_HOLDERS else ""
        return f"dynamic-mig {left}/{len(slices)} slices free" + (f": {held}{more}" if parts else "")
    if state == "shared":
        memory = dra.get("shared_memory") or {}
        return f"shared {len(shares)} shares, {memory.get('allocated', '0')} of {memory.get('capacity', '?')} held"
    note = str(publish.get("note") or "")
    return f"{state}: {note}" if note else ""


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def render(state: Mapping[str, Any], rows: Sequence[StatusRow]) -> str:
    node = state.get("node") or {}
    lines = [
        f"node {node.get('name', '?')}  {state.get('status', '')}  backend {state.get('backend', '')}"
        f"  driver {state.get('driver_version') or '-'}",
        f"{'GPU':>3}  {'OWNER':<22}  {'HEALTH':<9}  {'UTIL':>4}  {'MEMORY':>13}  HELD BY",
    ]
    for r in rows:
        owner = r.owner if r.desired == r.owner or r.owner.startswith("draining:") else f"{r.owner}>{r.desired}"
        owner = owner.replace("draining:", "drain ").replace("device-plugin", "dp")
        util = _util(r)
        if r.memory_used_mib is not None and r.memory_total_mib:
            memory = f"{r.memory_used_mib / 1024:.0f}/{r.memory_total_mib / 1024:.0f}GiB"
        elif r.memory_total_mib:
            memory = f"-/{r.memory_total_mib / 1024:.0f}GiB"
        else:
            memory = "-"
        held = ", ".join(r.holders[:SHOWN_HOLDERS]) or "-"
        if len(r.holders) > SHOWN_HOLDERS:
            held += f" +{len(r.holders) - SHOWN_HOLDERS}"
        lines.append(f"{r.index:>3}  {owner[:22]:<22}  {r.health[:9]:<9}  {util:>4}  {memory:>13}  {held[:21]}")
        if r.partitioning:
            lines.append(_fit(f"     {r.partitioning}"))
        if r.health != "healthy" and r.cause:
            lines.append(f"     {r.cause[:75]}")
    if not rows:
        lines.append("  (no GPUs)")
    lines.extend(_notes(state))
    return "\n".join(lines)


def _util(r: StatusRow) -> str:
    if r.gpu_percent is not None:
        return f"{r.gpu_percent:.0f}%"
    if r.utilization_known is False:
        return "?"
    if r.utilization_known and r.mig_enabled:
        return "mig"
    return "-"


def _notes(state: Mapping[str, Any]) -> list[str]:
    """Lines under the table: orphaned allocations and watchdog disagreements, when there are any."""
    lines: list[str] = []
    orphans = state.get("orphans") or {}
    listed = [o for o in (orphans.get("orphans") or ()) if isinstance(o, dict)]
    count = orphans.get("count") if isinstance(orphans.get("count"), int) else len(listed)
    if count:
        lines.append(f"orphaned allocations: {count}")
        for o in listed[:SHOWN_NOTES]:
            who = f"{o.get('namespace')}/{o.get('name')}" if o.get("name") else f"claim {o.get('uid')}"
            lines.append(_fit(f"  {o.get('kind')} {who}"))
            lines.append(_fit(f"    {o.get('reason', '')}"))
    watchdog = state.get("watchdog") or {}
    disagreements = [d for d in (watchdog.get("disagreements") or ()) if isinstance(d, dict)]
    if disagreements:
        lines.append(f"watchdog: {len(disagreements)} disagreement(s) with the node")
        for d in disagreements[:SHOWN_NOTES]:
            lines.append(_fit(f"  {d.get('state')}: {d.get('mechanism')} {d.get('check')}"))
            lines.append(_fit(f"    {d.get('detail', '')}"))
    return lines


def _fit(line: str) -> str:
    return line if len(line) <= WIDTH else line[: WIDTH - 3] + "..."
