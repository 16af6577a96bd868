"""The node's current inventory, and a feed of changes to it.

The composition root is the only writer (at start and from the inventory refresh); every
consumer reads :attr:`InventoryState.current` when it needs the devices and subscribes to
:attr:`InventoryState.changes` to hear that they changed, instead of keeping a copy that
someone has to push to it.
"""

from __future__ import annotations

from agent.base.feeds import Broadcast
from agent.core.inventory.model import Inventory


class InventoryState:
    def __init__(self, inventory: Inventory) -> None:
        self.current = inventory
        #: the new inventory, each time it differs from the previous one
        self.changes: Broadcast[Inventory] = Broadcast()

    def update(self, inventory: Inventory) -> bool:
        """Install ``inventory``; publishes and returns True only when it differs."""
        if inventory == self.current:
            return False
        self.current = inventory
        self.changes.publish(inventory)
        return True
