"""The node's shared state: config, inventory, health and ownership, and what a mechanism is."""
