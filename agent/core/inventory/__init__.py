"""Device inventory: the immutable model of the node's devices, and the current inventory with its change feed."""
