"""The local debug HTTP endpoint: probes, metrics and state."""
