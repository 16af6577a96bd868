"""``gpu-agent config plan``: what a config would do to one node's GPUs, before it is applied.

Per GPU: the owner it is granted now, the owner the new config wants, the rule that decided,
and — when the owner would change — what the move would wait for: the pods or claims holding
the GPU, and an answer from the mechanism it leaves when that one cannot tell who uses its GPUs
(the handover never takes an unknown user for idle, so without the answer it waits forever). The current
state comes from a running agent's ``/debug/state`` when one answers (its inventory, labels,
grants and holders); otherwise from the local inventory, with the current grant unknown.
The live agent logs the same rows before it applies a reload (:func:`plan_rows` is shared).
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.core.config.schema import Config
from agent.core.inventory.model import Gpu, Inventory, MigDevice
from agent.core.ownership.table import OwnershipTable, compute_ownership

UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class PlanRow:
    index: int
    uuid: str
    #: granted owner now (or ``draining:a->b``), "unknown" without a running agent
    current: str
    desired: str
    rule: str
    #: what the move waits for, when the owner would change: holders ("pod ns/name", "claim
    #: ns/name"), and an answer from the mechanism it leaves when that one cannot tell
    waits_for: tuple[str, ...] = ()

    @property
    def moves(self) -> bool:
        """The owner would change (unknown without a running agent: not counted as a move)."""
        return self.current not in (self.desired, UNKNOWN)

    def as_dict(self) -> dict[str, object]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "current": self.current,
            "desired": self.desired,
            "rule": self.rule,
            "moves": self.moves,
            "waits_for": list(self.waits_for),
        }


def plan_rows(
    inventory: Inventory,
    desired: OwnershipTable,
    *,
    current: Mapping[str, str],
    holders: Mapping[str, Sequence[str]],
    unknown: Mapping[str, str] | None = None,
) -> list[PlanRow]:
    """Rows for ``desired`` against ``current`` (GPU -> owner state) and ``holders`` (GPU -> users).

    ``unknown``: mechanism -> why it cannot tell who uses its GPUs now (PodResources missing, say).
    """
    rows = []
    for gpu in sorted(inventory.gpus, key=lambda g: g.index):
        now = current.get(gpu.uuid, UNKNOWN)
        want = desired.owner_of(gpu.uuid).value
        waits: tuple[str, ...] = ()
        if now != want:
            waits = tuple(holders.get(gpu.uuid, ()))
            source = drains_from(now)
            if source is not None and source != want and unknown and source in unknown:
                waits += (f"an answer from {source} on who uses it: {unknown[source] or 'no answer yet'}",)
        rows.append(PlanRow(gpu.index, gpu.uuid, now, want, desired.rules.get(gpu.uuid, ""), waits))
    return rows


def drains_from(current: str) -> str | None:
    """The mechanism a GPU in owner state ``current`` would drain from when it moves (None: none).

    A draining GPU still drains from its old owner, whatever the new target; moving it back to
    that owner ends the drain (nothing moved), which the caller sees as ``source == want``.
    """
    if current.startswith("draining:"):
        return current.removeprefix("draining:").split("->", 1)[0]
    return None if current in (UNKNOWN, "none") else current


def unknown_usage(mechanisms: Mapping[str, Any]) -> dict[str, str]:
    """Mechanism -> reason, for those of a state document's ``mechanisms`` that cannot tell who uses their GPUs."""
    out: dict[str, str] = {}
    for name, mechanism in mechanisms.items():
        usage = mechanism.get("usage") if isinstance(mechanism, Mapping) else None
        if isinstance(usage, Mapping) and not usage.get("known", True):
            out[str(name)] = str(usage.get("reason") or "")
    return out


@dataclass(frozen=True, slots=True)
class Plan:
    node: str
    #: where the current state came from
    source: str
    rows: tuple[PlanRow, ...]
    warnings: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, object]:
        return {
            "node": self.node,
            "source": self.source,
            "gpus": [r.as_dict() for r in self.rows],
            "warnings": list(self.warnings),
        }

    def render(self) -> str:
        return render(self.rows, node=self.node, source=self.source, warnings=self.warnings)


def render(rows: Sequence[PlanRow], *, node: str, source: str, warnings: Sequence[str] = ()) -> str:
    """A table readable at 80 columns (UUIDs cut to 11 characters, rules without "ownership.")."""
    lines = [f"node {node}: {source}", f"{'GPU':>3}  {'UUID':<11}  {'NOW':<27}  {'NEW':<13}  RULE"]
    for r in rows:
        mark = "*" if r.moves else " "
        rule = r.rule.removeprefix("ownership.")
        lines.append(f"{r.index:>3}{mark} {r.uuid[:11]:<11}  {r.current:<27}  {r.desired:<13}  {rule}")
        if r.waits_for:
            shown = ", ".join(r.waits_for[:5]) + (f" and {len(r.waits_for) - 5} more" if len(r.waits_for) > 5 else "")
            lines.extend(textwrap.wrap(f"waits for {shown}", 80, initial_indent=" " * 6, subsequent_indent=" " * 8))
    moving = [r for r in rows if r.moves]
    if any(r.current == UNKNOWN for r in rows):
        lines.append("current owners unknown: start the agent (or pass --debug-addr) to see what would move")
    else:
        lines.append(f"{len(moving)} of {len(rows)} GPUs would move" + (" (marked *)" if moving else ""))
    lines.extend(f"warning: {w}" for w in warnings)
    return "\n".join(lines)


def inventory_from_state(state: Mapping[str, Any]) -> Inventory:
    """The agent's inventory as its state document describes it (what ownership needs)."""
    gpus = []
    for d in state["devices"]:
        migs = tuple(
            MigDevice(
                uuid=str(m["uuid"]),
                parent_uuid=str(d["uuid"]),
                index=int(m.get("index", i)),
                gpu_instance_id=int(m.get("gpu_instance_id", 0)),
                compute_instance_id=int(m.get("compute_instance_id", 0)),
                profile=str(m.get("profile", "")),
                memory_mib=int(m.get("memory_mib", 0)),
            )
            for i, m in enumerate(d.get("mig") or ())
        )
        gpus.append(
            Gpu(
                uuid=str(d["uuid"]),
                index=int(d["index"]),
                minor=int(d.get("minor", d["index"])),
                product_name=str(d.get("product_name", "")),
                architecture=str(d.get("architecture", "")),
                compute_capability=str(d.get("compute_capability", "")),
                memory_mib=int(d.get("memory_mib", 0)),
                pci_bus_id=str(d.get("pci_bus_id", "")),
                numa_node=d.get("numa_node"),
                mig_enabled=bool(d.get("mig_enabled", False)),
                mig_devices=migs,
            )
        )
    return Inventory(
        backend=str(state.get("backend", "")),
        driver_version=str(state.get("driver_version", "")),
        cuda_driver_version=str(state.get("cuda_driver_version", "")),
        gpus=tuple(gpus),
    )


def holders_from_state(state: Mapping[str, Any]) -> dict[str, list[str]]:
    """GPU -> "kind ns/name" of everything holding it, through any mechanism."""
    out: dict[str, list[str]] = {}
    for d in state["devices"]:
        for mechanism_holders in (d.get("holders") or {}).values():
            for h in mechanism_holders:
                kind = "claim" if h.get("kind") == "claim" else "pod"
                out.setdefault(str(d["uuid"]), []).append(f"{kind} {h.get('namespace')}/{h.get('name')}")
    return out


def plan_against_state(config: Config, state: Mapping[str, Any], *, labels: Mapping[str, str]) -> Plan:
    """The plan for ``config`` on the node a running agent describes."""
    node = state.get("node") or {}
    inventory = inventory_from_state(state)
    merged = {**(node.get("labels") or {}), **labels}
    name = str(node.get("name", ""))
    desired = compute_ownership(inventory, config.ownership, node_name=name, node_labels=merged, version="plan")
    current = {str(d["uuid"]): str(d["owner"]) for d in state["devices"]}
    unknown = unknown_usage(state.get("mechanisms") or {})
    rows = plan_rows(inventory, desired, current=current, holders=holders_from_state(state), unknown=unknown)
    return Plan(name, "current state from the running agent", tuple(rows), desired.inert_overrides)


def plan_against_inventory(config: Config, inventory: Inventory, *, node_name: str, labels: Mapping[str, str]) -> Plan:
    """The plan without a running agent: the desired owners only; current grants are unknown."""
    desired = compute_ownership(inventory, config.ownership, node_name=node_name, node_labels=labels, version="plan")
    rows = plan_rows(inventory, desired, current={}, holders={})
    source = f"no running agent; local {inventory.backend or 'no'} inventory, current owners unknown"
    return Plan(node_name, source, tuple(rows), desired.inert_overrides)
