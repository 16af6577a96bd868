"""Which mechanism owns each physical GPU: the one place both mechanisms ask "is this mine?".

The table is a pure function of (inventory, ownership config, node name, node labels) and
is recomputed whenever one of those changes. MIG devices always belong to their parent's
owner. Live handover (draining) is a separate concern layered on top of this table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.config.schema import NodeRule, Owner, OwnershipConfig
from agent.errors import ConfigError
from agent.events import Broadcast
from agent.inventory.model import Inventory


@dataclass(frozen=True, slots=True)
class OwnershipTable:
    #: config version the table was computed from
    version: str
    #: GPU UUID -> owner, and MIG UUID -> its parent's owner
    owners: Mapping[str, Owner] = field(default_factory=dict)
    #: MIG UUID -> parent GPU UUID
    parents: Mapping[str, str] = field(default_factory=dict)
    #: where the node's default came from ("cluster default" or "ownership.nodes[i]")
    node_rule: str = "cluster default"

    def owner_of(self, uuid: str) -> Owner:
        """The owner of a GPU or MIG device; devices not on the node belong to nobody."""
        return self.owners.get(uuid, Owner.NONE)

    def granted_to(self, uuid: str, owner: Owner) -> bool:
        """Whether ``owner`` may advertise and hand out this GPU or MIG device now.

        The one question both mechanisms ask, for every device they list, publish, allocate
        or prepare; nothing else decides "is this GPU mine".
        """
        return self.owner_of(uuid) is owner

    def gpus_granted_to(self, owner: Owner) -> frozenset[str]:
        """Physical GPUs (no MIG devices) granted to ``owner``."""
        return frozenset(u for u, o in self.owners.items() if o is owner and u not in self.parents)

    def counts(self) -> dict[Owner, int]:
        out = dict.fromkeys(Owner, 0)
        for uuid, owner in self.owners.items():
            if uuid not in self.parents:
                out[owner] += 1
        return out


def node_rule_for(
    config: OwnershipConfig, node_name: str, node_labels: Mapping[str, str]
) -> tuple[int, NodeRule] | None:
    """The first ``ownership.nodes`` rule matching this node (by name or by all its labels)."""
    for i, rule in enumerate(config.nodes):
        by_name = bool(rule.match.names) and node_name in rule.match.names
        by_labels = bool(rule.match.labels) and all(node_labels.get(k) == v for k, v in rule.match.labels.items())
        if by_name or by_labels:
            return i, rule
    return None


def compute_ownership(
    inventory: Inventory,
    config: OwnershipConfig,
    *,
    node_name: str,
    node_labels: Mapping[str, str],
    version: str,
) -> OwnershipTable:
    """Apply cluster default, then the node rule, then per-GPU overrides.

    Raises ConfigError when a per-GPU override names a UUID or index that is not on the
    node: that is almost always a typo, and silently ignoring it would hand the GPU to the
    wrong mechanism.
    """
    default = config.default
    overrides: Mapping[str, Owner] = {}
    rule_label = "cluster default"
    matched = node_rule_for(config, node_name, node_labels)
    if matched is not None:
        index, rule = matched
        rule_label = f"ownership.nodes[{index}]"
        if rule.default is not None:
            default = rule.default
        overrides = rule.gpus

    owners: dict[str, Owner] = {gpu.uuid: default for gpu in inventory.gpus}
    for key, owner in overrides.items():
        gpu = inventory.find(key)
        if gpu is None:
            raise ConfigError(f"{rule_label}.gpus[{key!r}]: no GPU with that UUID or index on node {node_name!r}")
        owners[gpu.uuid] = owner

    parents: dict[str, str] = {}
    for gpu in inventory.gpus:
        for mig in gpu.mig_devices:
            owners[mig.uuid] = owners[gpu.uuid]
            parents[mig.uuid] = gpu.uuid
    return OwnershipTable(version=version, owners=owners, parents=parents, node_rule=rule_label)


class OwnershipState:
    """Holds the current table and tells subscribers when it changes."""

    def __init__(self, table: OwnershipTable | None = None) -> None:
        self.current = table or OwnershipTable(version="")
        self.changes: Broadcast[OwnershipTable] = Broadcast()

    def update(self, table: OwnershipTable) -> bool:
        """Install ``table``; returns whether any owner changed (and only then publishes)."""
        changed = dict(table.owners) != dict(self.current.owners)
        self.current = table
        if changed:
            self.changes.publish(table)
        return changed
