"""This Node's ``status.allocatable`` as the API server has it, for the registration watchdog.

The watchdog compares the allocatable counts the scheduler sees with what the agent advertises.
They come from the Node watch the agent keeps anyway for its labels
(:class:`agent.kube.labels.NodeLabelSource` is a :class:`NodeStatusSource`): the kubelet posts
node status when it changes, and the watch brings it, so the comparison costs no request.
Only extended resources (names with a ``/``) with a whole-number count are kept.
"""

from __future__ import annotations

import re
from typing import Protocol

from agent.core.mechanism import NodeStatus

_COUNT = re.compile(r"\d{1,9}")


class NodeStatusSource(Protocol):
    async def refresh(self) -> None:
        """Bring :attr:`status` up to date if the source needs asking; never raises."""
        ...

    @property
    def status(self) -> NodeStatus:
        """The Node's allocatable, or unknown with the reason (the node checks are then skipped)."""
        ...


def allocatable_of(node: object) -> dict[str, int]:
    """Extended resources of a Node object's ``status.allocatable`` with whole-number counts."""
    status = node.get("status") if isinstance(node, dict) else None
    allocatable = status.get("allocatable") if isinstance(status, dict) else None
    if not isinstance(allocatable, dict):
        return {}
    out: dict[str, int] = {}
    for name, value in allocatable.items():
        if isinstance(name, str) and "/" in name and isinstance(value, str | int) and _COUNT.fullmatch(str(value)):
            out[name[:253]] = int(value)
    return out


class NoApiNodeStatus:
    """No API access: the Node's status is never known (the node checks are skipped)."""

    def __init__(self, reason: str = "no Kubernetes API access") -> None:
        self.status = NodeStatus(reason=reason)

    async def refresh(self) -> None:
        return None
