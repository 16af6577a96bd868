"""This Node's ``status.allocatable`` as the API server has it, for the registration watchdog.

The label source reads the Node's metadata only (``PartialObjectMetadata``), which has no status.
The watchdog needs the allocatable counts the scheduler sees, so :class:`NodeStatusReader` GETs the
whole Node now and then. A periodic GET rather than a second watch: the kubelet itself reads its
Node this way every 10 s, with ``resourceVersion=0`` so the API server answers from its cache;
one more such read per watchdog interval is a small constant load with no stream to keep
alive and no relist logic, and the node status it reads changes only every 10 s anyway.
Only extended resources (names with a ``/``) with a whole-number count are kept.
"""

from __future__ import annotations

import re
from typing import Protocol
from urllib.parse import quote

from agent.core.mechanism import NodeStatus
from agent.kube.client import KubeClient
from agent.kube.errors import KubeError

#: a Node with hundreds of cached images is a few hundred KiB
NODE_MAX_BYTES = 4 * 1024 * 1024
NODE_TIMEOUT_S = 5.0
_COUNT = re.compile(r"\d{1,9}")


class NodeStatusSource(Protocol):
    async def refresh(self) -> None:
        """Read the Node again; never raises (a failure makes the status unknown, with the reason)."""
        ...

    @property
    def status(self) -> NodeStatus: ...


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


class NodeStatusReader:
    def __init__(self, client: KubeClient, *, node_name: str, timeout_s: float = NODE_TIMEOUT_S) -> None:
        self._client = client
        self._path = f"/api/v1/nodes/{quote(node_name, safe='')}"
        self._timeout_s = timeout_s
        self.status = NodeStatus(reason="not read yet")

    async def refresh(self) -> None:
        try:
            node = await self._client.get(
                self._path, {"resourceVersion": "0"}, timeout_s=self._timeout_s, max_bytes=NODE_MAX_BYTES
            )
        except KubeError as exc:
            self.status = NodeStatus(reason=f"reading the Node: {exc}")
            return
        self.status = NodeStatus(allocatable=allocatable_of(node))


class NoApiNodeStatus:
    """No API access: the Node's status is never known (the node checks are skipped)."""

    def __init__(self, reason: str = "no Kubernetes API access") -> None:
        self.status = NodeStatus(reason=reason)

    async def refresh(self) -> None:
        return None
