"""Kubernetes Events about this node, as the core and the observers post them.

:class:`EventSink` is what handovers, orphan checks and the watchdog are given to tell operators
something on the Node object; ``agent.kube.recorder.EventRecorder`` is the real one. Without
API access the root gives None, and only logs and counters remain.
"""

from __future__ import annotations

from typing import Protocol


class EventSink(Protocol):
    """Posts an Event about the node; never blocks, never raises (``agent.kube.recorder``)."""

    def normal(self, reason: str, message: str) -> None: ...

    def warning(self, reason: str, message: str) -> None: ...
