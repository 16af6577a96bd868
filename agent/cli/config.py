"""``gpu-agent config check``: explain what a config means for one node."""

from __future__ import annotations

from collections.abc import Mapping

from agent.core.config.schema import Config
from agent.core.ownership.publish import compute_publish_modes
from agent.core.ownership.table import compute_ownership, first_match, node_rule_for


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
    lines.extend(_describe_publish(config, node_name=node_name, labels=labels))
    if config.backend == "simulated":
        from agent.backends.simulated import SimulatedBackend

        backend = SimulatedBackend(preset=config.preset, node_name=node_name, health=config.health)
        inventory = await backend.load()
        table = compute_ownership(inventory, ownership, node_name=node_name, node_labels=labels, version="check")
        modes = compute_publish_modes(inventory, config.dra, node_name=node_name, node_labels=labels)
        lines.append(f"  per GPU on simulated preset {config.preset} (owner, DRA publish mode):")
        for gpu in inventory.gpus:
            lines.append(
                f"    {gpu.index}  {gpu.uuid}  {table.owner_of(gpu.uuid).value}  {modes.mode_of(gpu.uuid).value}"
            )
        for warning in (*table.inert_overrides, *modes.inert):
            lines.append(f"  warning: {warning}")
    return "\n".join(lines)


def _describe_publish(config: Config, *, node_name: str, labels: Mapping[str, str]) -> list[str]:
    """How DRA publishes the GPUs it owns on this node (``dra.publish``)."""
    publish = config.dra.publish
    matched = first_match(publish.nodes, node_name, labels)
    sharing = config.dra.sharing
    shared = (
        f"shares: default {sharing.default_memory_mib} MiB, step {sharing.memory_step_mib} MiB, "
        f"{'MPS limits' if sharing.mps else 'time-sliced, memory not enforced'}"
    )
    if matched is None:
        lines = [f"  DRA publishes GPUs {publish.default.value} (dra.publish.default); {shared}"]
        return lines
    index, rule = matched
    default = rule.default or publish.default
    lines = [f"  matched dra.publish.nodes[{index}]; DRA publishes GPUs {default.value}; {shared}"]
    lines.extend(f"  GPU {key}: published {mode.value}" for key, mode in rule.gpus.items())
    return lines
