"""Per-device health: signals from the backends, policy, and the monitor that owns the record."""
