"""``gpu-agent config check``: explain what a config means for one node."""

from __future__ import annotations

from collections.abc import Mapping

from agent.core.config.schema import Config
from agent.core.ownership.table import compute_ownership, node_rule_for


async def describe_ownership(config: Config, *, node_name: str, labels: Mapping[str, str]) -> str:
    """Lines describing the effective ownership; with the simulated backend, per GPU."""
    ownership = config.ownership
    matched = node_rule_for(ownership, node_name, labels)
    lines = [f"node {node_name or '(unnamed)'} labels {dict(labels) or '{}'}"]
    if matched is None:
        lines.append(f"  no node rule matches; cluster default owner: {ownership.default.value}")
        overrides: Mapping[str, object] = {}
    else:
        index, rule = matched
        default = rule.default or ownership.default
        lines.append(f"  matched ownership.nodes[{index}]; default owner: {default.value}")
        overrides = rule.gpus
    for key, owner in overrides.items():
        lines.append(f"  GPU {key}: {getattr(owner, 'value', owner)}")
    if config.backend == "simulated":
        from agent.backends.simulated import SimulatedBackend

        backend = SimulatedBackend(preset=config.preset, node_name=node_name, health=config.health)
        inventory = await backend.load()
        table = compute_ownership(inventory, ownership, node_name=node_name, node_labels=labels, version="check")
        lines.append(f"  per GPU on simulated preset {config.preset}:")
        for gpu in inventory.gpus:
            lines.append(f"    {gpu.index}  {gpu.uuid}  {table.owner_of(gpu.uuid).value}")
        for warning in table.inert_overrides:
            lines.append(f"  warning: {warning}")
    return "\n".join(lines)
