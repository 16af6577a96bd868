"""Which mechanism owns each physical GPU: the desired and granted tables, the handover, the plan."""
