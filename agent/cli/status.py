"""``gpu-agent status``: the node's GPUs at a glance, from the running agent's ``/debug/state``.

The first line says whether the agent is ready, as ``/readyz`` does; the failing checks, a
config change the agent refused (it runs on the last good one) and the mechanisms that cannot
tell who holds their GPUs are named under the table. Per GPU: owner (granted, and the desired
one when they differ), health, who holds it and how busy it is. HELD BY reads ``-`` when nobody
holds the GPU and ``?`` when that is unknown (the mechanism that owns it, or that it drains
from, cannot tell: no PodResources socket, say). Readable at 80 columns; ``--json`` prints the
same as JSON for scripts.

UTIL reads ``42%``, ``mig`` (MIG mode: NVML has no utilization counter), ``?`` (the newest
reading is missing or stale: NVML failing or hung) or ``-`` (not sampled). Orphaned
allocations and watchdog repairs, when there are any, follow the table.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.core.ownership.plan import drains_from, unknown_usage

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
    #: False: a mechanism that may hold the GPU (its owner, or the one it drains from) cannot tell
    holders_known: bool = True

    def as_dict(self) -> dict[str, object]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "owner": self.owner,
            "desired_owner": self.desired,
            "health": self.health,
            "health_cause": self.cause,
            "holders": list(self.holders),
            "holders_known": self.holders_known,
            "gpu_utilization_percent": self.gpu_percent,
            "memory_used_mib": self.memory_used_mib,
            "memory_total_mib": self.memory_total_mib,
            "utilization_known": self.utilization_known,
            "utilization_reason": self.utilization_reason,
        }


def rows_from_state(state: Mapping[str, Any]) -> list[StatusRow]:
    rows = []
    unknown = unknown_usage(state.get("mechanisms") or {})
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
                holders_known=drains_from(str(d.get("owner", ""))) not in unknown,
            )
        )
    return sorted(rows, key=lambda r: r.index)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def summary(state: Mapping[str, Any], rows: Sequence[StatusRow]) -> dict[str, object]:
    """``status --json``: the node, whether it is ready and why not, a refused config, the rows."""
    readiness = state.get("readiness") or {}
    checks = readiness.get("checks") or {}
    config = state.get("config") or {}
    return {
        "node": (state.get("node") or {}).get("name"),
        "ready": readiness.get("ready"),
        "not_ready": {name: checks.get(name, "") for name in readiness.get("failing") or ()},
        "config_error": config.get("last_error") or None,
        "holders_unknown": unknown_usage(state.get("mechanisms") or {}),
        "gpus": [r.as_dict() for r in rows],
    }


def _ready(state: Mapping[str, Any]) -> str:
    readiness = state.get("readiness")
    if not isinstance(readiness, Mapping):
        return "readiness ?"  # an agent from before the state document carried it
    return "ready" if readiness.get("ready") else "NOT READY"


def render(state: Mapping[str, Any], rows: Sequence[StatusRow]) -> str:
    node = state.get("node") or {}
    lines = [
        _fit(
            f"node {node.get('name', '?')}  {_ready(state)}  {state.get('status', '')}"
            f"  backend {state.get('backend', '')}  driver {state.get('driver_version') or '-'}"
        ),
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
        held = ", ".join(r.holders[:SHOWN_HOLDERS])
        if len(r.holders) > SHOWN_HOLDERS:
            held += f" +{len(r.holders) - SHOWN_HOLDERS}"
        if not r.holders_known:
            held = f"{held} +?" if held else "?"
        held = held or "-"
        lines.append(f"{r.index:>3}  {owner[:22]:<22}  {r.health[:9]:<9}  {util:>4}  {memory:>13}  {held[:21]}")
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
    """Lines under the table: why the agent is not ready, a refused config, holders nobody can
    name, orphaned allocations and watchdog disagreements, when there are any."""
    lines: list[str] = []
    readiness = state.get("readiness") or {}
    checks = readiness.get("checks") or {}
    for name in readiness.get("failing") or ():
        lines.extend(_wrap(f"not ready: {name}: {checks.get(name, '')}"))
    config = state.get("config") or {}
    if config.get("last_error"):
        lines.extend(
            _wrap(f"config refused, still on version {config.get('version', '?')}: {config.get('last_error')}")
        )
    for name, reason in unknown_usage(state.get("mechanisms") or {}).items():
        lines.extend(_wrap(f"held by ?: {name} cannot tell who uses its GPUs: {reason or 'no answer yet'}"))
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


def _wrap(text: str) -> list[str]:
    """A note over as many 80-column lines as it needs (at most 3), continuation lines indented."""
    return textwrap.wrap(text, WIDTH, subsequent_indent="    ", break_on_hyphens=False, max_lines=3, placeholder=" ...")


def _fit(line: str) -> str:
    return line if len(line) <= WIDTH else line[: WIDTH - 3] + "..."
