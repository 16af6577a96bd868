"""Device inventory: the model and the backends that fill it."""
