"""One reading of how busy the node's devices are: the backends' ``sample`` answers in these.

A reading is a moment's fact, not part of the inventory: the inventory says what a device is,
a sample what it is doing. ``None`` in a field means the device cannot say (MIG devices have no
utilization counter of their own; an integrated GPU has no memory of its own).
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class DeviceSample:
    """Utilization and memory of one GPU or MIG device."""

    uuid: str
    #: share of the last sample period in which a kernel ran, 0-100
    gpu_percent: float | None = None
    memory_used_mib: int | None = None
    memory_total_mib: int | None = None


def mib(value_bytes: int) -> int:
    return int(value_bytes) // MIB
