"""A claim as a holder of the GPUs its devices are on: how DRA reports its usage to the handover."""

from __future__ import annotations

from collections.abc import Iterable

from agent.core.mechanism import Holder


def add_claim(
    holders: dict[str, list[Holder]],
    *,
    namespace: str,
    name: str,
    uid: str,
    devices: Iterable[tuple[str, str]],
    detail: str = "",
    since: str = "",
) -> None:
    """Add the claim to ``holders`` (physical GPU -> holders) once per GPU that ``devices``
    ((GPU UUID, DRA device name) pairs) are on, naming that GPU's devices."""
    by_gpu: dict[str, list[str]] = {}
    for gpu, device in devices:
        by_gpu.setdefault(gpu, []).append(device)
    for gpu, names in by_gpu.items():
        holder = Holder(
            kind="claim",
            namespace=namespace,
            name=name,
            uid=uid,
            detail=detail,
            devices=tuple(dict.fromkeys(names)),
            since=since,
        )
        holders.setdefault(gpu, []).append(holder)
