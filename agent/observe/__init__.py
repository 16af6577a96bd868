"""What operators see: the debug endpoint, metrics, utilization, orphaned allocations, the registration watchdog."""
