"""Human and machine views of an inventory (``gpu-agent inventory``)."""

from __future__ import annotations

from typing import Any

from agent.core.inventory.model import Inventory, MigPlacement, MigProfile


def inventory_json(inventory: Inventory) -> dict[str, Any]:
    gpus = inventory.gpus
    return {
        "backend": inventory.backend,
        "driver_version": inventory.driver_version,
        "cuda_driver_version": inventory.cuda_driver_version,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "minor": g.minor,
                "product_name": g.product_name,
                "architecture": g.architecture,
                "compute_capability": g.compute_capability,
                "memory_mib": g.memory_mib,
                "pci_bus_id": g.pci_bus_id,
                "numa_node": g.numa_node,
                "pcie_root": g.pcie_root,
                "brand": g.brand,
                "mig_enabled": g.mig_enabled,
                "mig_devices": [
                    {
                        "index": m.index,
                        "uuid": m.uuid,
                        "profile": m.profile,
                        "gpu_instance_id": m.gpu_instance_id,
                        "compute_instance_id": m.compute_instance_id,
                        "memory_mib": m.memory_mib,
                        "profile_id": m.profile_id,
                        "placement": placement_text(m.placement) if m.placement is not None else None,
                    }
                    for m in g.mig_devices
                ],
                "mig_memory_slices": g.mig_memory_slices,
                "mig_profiles": [profile_json(p) for p in g.mig_profiles],
            }
            for g in gpus
        ],
        "topology": topology_map(inventory),
        "problems": list(inventory.problems),
        "reason": inventory.reason,
    }


def placement_text(placement: MigPlacement) -> str:
    """``nvidia-smi mig``'s notation: ``start:size`` in memory slices."""
    return f"{placement.start}:{placement.size}"


def profile_json(profile: MigProfile) -> dict[str, Any]:
    return {
        "name": profile.name,
        "profile_id": profile.profile_id,
        "compute_slices": profile.compute_slices,
        "memory_slices": profile.memory_slices,
        "memory_mib": profile.memory_mib,
        "multiprocessors": profile.multiprocessors,
        "max_instances": profile.max_instances,
        "placements": [placement_text(p) for p in profile.placements],
        "copy_engines": profile.copy_engines,
        "decoders": profile.decoders,
        "encoders": profile.encoders,
        "jpeg_engines": profile.jpeg_engines,
        "ofa_engines": profile.ofa_engines,
    }


def topology_map(inventory: Inventory) -> dict[str, str]:
    """``"<i>-<j>"`` -> ``NV18`` / ``PIX`` / ``SYS``... for every pair of GPUs."""
    gpus = inventory.gpus
    return {
        f"{a.index}-{b.index}": inventory.link(a.uuid, b.uuid).describe()
        for i, a in enumerate(gpus)
        for b in gpus[i + 1 :]
    }


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def inventory_table(inventory: Inventory) -> str:
    problems = [f"  {p}" for p in inventory.problems]
    if not inventory.gpus:
        why = f": {inventory.reason}" if inventory.reason else ""
        tail = ["", "could not read:", *problems] if problems else []
        return "\n".join([f"backend: {inventory.backend}", f"no GPUs on this node{why}", *tail])
    lines = [
        f"backend: {inventory.backend}   driver: {inventory.driver_version}   CUDA: {inventory.cuda_driver_version}",
        "",
    ]
    rows = [["IDX", "UUID", "PRODUCT", "ARCH", "CC", "MEMORY", "PCI BUS", "NUMA", "MIG"]]
    for g in inventory.gpus:
        rows.append(
            [
                str(g.index),
                g.uuid,
                g.product_name,
                g.architecture,
                g.compute_capability,
                f"{g.memory_mib} MiB",
                g.pci_bus_id,
                "-" if g.numa_node is None else str(g.numa_node),
                f"{len(g.mig_devices)} devices" if g.mig_enabled else "off",
            ]
        )
        for m in g.mig_devices:
            rows.append(
                [
                    "",
                    f"  {m.uuid}",
                    f"  MIG {m.profile}",
                    "",
                    "",
                    f"{m.memory_mib} MiB",
                    "",
                    "",
                    f"gi {m.gpu_instance_id} ci {m.compute_instance_id}",
                ]
            )
    lines.append(_table(rows))
    gpus = inventory.gpus
    if len(gpus) > 1:
        lines += ["", "topology:"]
        header = [""] + [f"GPU{g.index}" for g in gpus]
        matrix = [header]
        for a in gpus:
            matrix.append(
                [f"GPU{a.index}"] + ["X" if a is b else inventory.link(a.uuid, b.uuid).describe() for b in gpus]
            )
        lines.append(_table(matrix))
    if problems:
        lines += ["", "could not read:", *problems]
    return "\n".join(lines)
