"""The node's three per-GPU sources of truth, carried together.

Every mechanism and most observers read the same three things about the node's GPUs: which
there are (:class:`~agent.core.inventory.current.InventoryState`), how each is
(:class:`~agent.core.health.monitor.HealthMonitor`) and who may use it
(:class:`~agent.core.ownership.table.OwnershipState`). The composition root builds each once and
hands them on as one :class:`NodeFacts`; each keeps its own change feed and its one writer, and
:class:`NodeFacts` holds nothing of its own.

Only these three travel together: the config, the metrics registry and the CDI service go to
some consumers and not others, and are passed on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.core.health.monitor import HealthMonitor
from agent.core.inventory.current import InventoryState
from agent.core.ownership.table import OwnershipState


@dataclass(frozen=True, slots=True)
class NodeFacts:
    inventory: InventoryState
    health: HealthMonitor
    ownership: OwnershipState
