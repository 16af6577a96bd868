"""How DRA should publish each GPU (``dra.publish``): ``whole``, ``dynamic-mig`` or ``shared``.

The desired publish mode is a pure function of the inventory, the config, the node's name and
labels — :func:`compute_publish_modes` — with the match rules of ownership
(:func:`agent.core.ownership.table.first_match`): the ``dra.publish`` default, then the first
``dra.publish.nodes`` rule that matches the node, then that rule's per-GPU entries by UUID or
index. A per-GPU entry naming no GPU of this node is inert and listed, as ownership's are.

The mode only matters for GPUs DRA is granted. DRA decides when a *change* of mode takes
effect (``agent.dra.modes``): a GPU whose prepared claims the new shape cannot honour waits
for them, unpublished meanwhile, as a handover does. This module only says what is wanted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.base.feeds import Broadcast
from agent.core.config.schema import DraConfig, PublishMode, SharingConfig
from agent.core.inventory.model import Inventory
from agent.core.ownership.table import per_gpu


@dataclass(frozen=True, slots=True)
class PublishTable:
    """The desired publish mode of each GPU of the node, and the rule that chose it."""

    #: config version the table was computed from
    version: str = ""
    #: GPU UUID -> mode; a GPU not listed (not on the node) is published whole
    modes: Mapping[str, PublishMode] = field(default_factory=dict)
    #: GPU UUID -> the rule that decided it ("dra.publish.default", "dra.publish.nodes[0].gpus['3']", ...)
    rules: Mapping[str, str] = field(default_factory=dict)
    #: per-GPU entries that name no GPU on this node: inert until such a GPU appears
    inert: tuple[str, ...] = ()
    #: ``dra.sharing``: how shared GPUs are published and prepared
    sharing: SharingConfig = field(default_factory=SharingConfig)

    def mode_of(self, gpu_uuid: str) -> PublishMode:
        return self.modes.get(gpu_uuid, PublishMode.WHOLE)


def compute_publish_modes(
    inventory: Inventory,
    dra: DraConfig,
    *,
    node_name: str,
    node_labels: Mapping[str, str],
    version: str = "",
) -> PublishTable:
    """The desired mode per GPU: ``dra.publish`` default, then the node rule, then its per-GPU entries."""
    choice = per_gpu(
        inventory,
        dra.publish.nodes,
        dra.publish.default,
        section="dra.publish",
        default_label="dra.publish.default",
        node_name=node_name,
        node_labels=node_labels,
    )
    return PublishTable(
        version=version, modes=choice.values, rules=choice.rules, inert=choice.inert, sharing=dra.sharing
    )


class PublishState:
    """The desired publish modes and a feed of changes; the composition root is the only writer."""

    def __init__(self, table: PublishTable | None = None) -> None:
        self.current = table or PublishTable()
        self.changes: Broadcast[PublishTable] = Broadcast()

    def update(self, table: PublishTable) -> bool:
        """Install ``table``; publishes and returns True only when a GPU's mode (or ``dra.sharing``) changed."""
        changed = dict(table.modes) != dict(self.current.modes) or table.sharing != self.current.sharing
        self.current = table
        if changed:
            self.changes.publish(table)
        return changed
