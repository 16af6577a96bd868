"""``gpu-agent config check``: explain what a config means for one node."""

from __future__ import annotations

from collections.abc import Mapping

from agent.base.errors import ConfigError
from agent.core.config.schema import Config
from agent.core.ownership.table import compute_ownership, node_rule_for


def check_preset_flag(preset: str | None, config: Config) -> None:
    """A ``--preset`` flag names a simulated node: refuse it unless the backend is simulated.

    Simulated GPUs are only ever chosen explicitly, so the flag does not imply ``--simulated``
    (on a real GPU node that would quietly show made-up GPUs); ignoring it would be worse.
    """
    if preset is not None and config.backend != "simulated":
        raise ConfigError(
            f"--preset {preset} describes a simulated node, but the backend is {config.backend}: add --simulated"
        )


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
