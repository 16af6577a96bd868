"""This Node's counts of the device plugin's resources, kept at or below what the plugin offers.

The scheduler places a pod that asks for ``nvidia.com/gpu`` by the Node's ``status.allocatable``
(kubernetes/kubernetes ``pkg/scheduler/framework/plugins/noderesources/fit.go``; with an
extended-resource DeviceClass a count of 0 sends the pod to DRA instead). The kubelet writes
that count only at its next node status sync (``nodeStatusUpdateFrequency``, 10 s), while its
device manager follows ListAndWatch within milliseconds: a GPU the device plugin stops listing
stays in the scheduler's view for up to 10 s, and every pod bound to it meanwhile fails at
admission ("no healthy devices present", ``UnexpectedAdmissionError``, never retried).

:class:`NodeCountsGuard` closes that gap from our side. The device plugin tells it the ceilings
(:meth:`NodeCountsGuard.lower_to`: per resource, what it lists less the GPUs it is giving up;
:mod:`agent.deviceplugin.nodeview`), and it:

* reads the Node (a GET from the API server's cache) and, where a resource of ours shows more
  allocatable than its ceiling, patches ``nodes/<node>/status`` (a JSON merge patch carrying the
  Node's resourceVersion, so a kubelet write in between makes it 409 and it reads again) down to
  the ceiling — capacity too where that is above. It never raises a count: the kubelet does that
  at its next sync, and the ValidatingAdmissionPolicy (``config/base/admission-policy.yaml``)
  allows the agent nothing else on its own Node;
* says since when the Node has shown each resource at or below its ceiling without a break
  (:meth:`NodeCountsGuard.held_since`): a ceiling that drops, or a read that shows more again,
  starts it over. A kubelet status write computed while the plugin still listed a closing GPU
  raises the count again; the guard lowers it again;
* reads the Node every :data:`POLL_S` for :data:`FAST_S` after a ceiling dropped, then every
  :data:`SLOW_POLL_S` until :data:`WATCH_S` (one kubelet status period and a margin), and at once
  whenever the plugin's list changed (a closing GPU is dropped just after a kubelet write raised
  the count: that is undone within one read), then not until the next change: a few requests
  per handover, none in steady state.

RBAC: ``patch`` on ``nodes/status`` (``config/base/rbac.yaml``), confined by the admission policy
to the agent's own Node and to lowering its own resources.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

import structlog

from agent.base.backoff import Backoff
from agent.core.mechanism import NodeCeiling
from agent.kube.client import KubeClient
from agent.kube.errors import KubeConflictError, KubeError

log = structlog.get_logger("agent.kube")

#: how often the Node is read while a ceiling is new (a closing GPU waits on it)
POLL_S = 0.2
#: for how long after a ceiling dropped it is read that often
FAST_S = 3.0
#: then this often, until WATCH_S after the change
SLOW_POLL_S = 1.0
#: one kubelet node status period (10 s) and a margin
WATCH_S = 12.0
#: one read or patch
TIMEOUT_S = 5.0
#: a Node with a long image list is some hundred KiB
NODE_MAX_BYTES = 4 * 1024 * 1024
RETRY_BACKOFF = Backoff(initial_s=0.2, factor=2.0, max_s=5.0, jitter=0.2)
_COUNT = re.compile(r"\d{1,9}")


def _count(status: Any, field: str, name: str) -> int | None:
    """``status.<field>[name]`` as a whole number; None when absent or not a plain count."""
    values = status.get(field) if isinstance(status, dict) else None
    value = values.get(name) if isinstance(values, dict) else None
    return int(value) if isinstance(value, str | int) and _COUNT.fullmatch(str(value)) else None


class NodeCountsGuard:
    """The real :class:`~agent.core.mechanism.NodeCounts` (see the module docstring)."""

    def __init__(
        self,
        client: KubeClient,
        *,
        node_name: str,
        clock: Callable[[], float] = time.monotonic,
        backoff: Backoff = RETRY_BACKOFF,
        sleep: Callable[[float], Any] = asyncio.sleep,
    ) -> None:
        self._client = client
        self.node_name = node_name
        self._path = f"/api/v1/nodes/{quote(node_name, safe='')}"
        self._clock = clock
        self._backoff = backoff
        self._sleep = sleep
        self._ceilings: dict[str, NodeCeiling] = {}
        self._held: dict[str, float] = {}
        self._fast_until = float("-inf")
        self._watch_until = float("-inf")
        self._kick = asyncio.Event()
        #: read from etcd, not the cache, next time (after a conflict)
        self._fresh = False
        self.reads = 0
        self.patches = 0
        self.conflicts = 0
        self.last_error = ""
        self.last_patch: dict[str, object] = {}

    # --- the NodeCounts interface (no I/O) --------------------------------------------------

    def lower_to(self, ceilings: Mapping[str, NodeCeiling]) -> None:
        # the plugin's list may have changed even where the ceilings did not (a closing GPU
        # dropped): read the Node again now, in case a kubelet status write raised it just before
        self._kick.set()
        if dict(ceilings) == self._ceilings:
            return
        now = self._clock()
        for name, ceiling in ceilings.items():
            old = self._ceilings.get(name)
            if old is None or ceiling.allocatable < old.allocatable or ceiling.capacity < old.capacity:
                self._held.pop(name, None)
                self._fast_until = now + FAST_S
        for name in set(self._held) - set(ceilings):
            del self._held[name]
        self._ceilings = dict(ceilings)
        self._watch_until = now + WATCH_S
        self._kick.set()

    def held_since(self, resource: str) -> float | None:
        return self._held.get(resource)

    def debug_state(self) -> dict[str, object]:
        now = self._clock()
        return {
            "enabled": True,
            "ceilings": {n: {"capacity": c.capacity, "allocatable": c.allocatable} for n, c in self._ceilings.items()},
            "held_for_s": {n: round(now - t, 3) for n, t in self._held.items()},
            "reads": self.reads,
            "patches": self.patches,
            "conflicts": self.conflicts,
            "last_patch": self.last_patch or None,
            "last_error": self.last_error or None,
        }

    # --- running ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Keep the Node's counts down until cancelled; API errors are retried with backoff."""
        attempt = 0
        while True:
            await self._wait()
            try:
                await self._check()
            except KubeError as exc:
                attempt += 1
                if str(exc) != self.last_error:
                    hint = " (the agent needs patch on nodes/status)" if exc.status == 403 else ""
                    log.warning("cannot lower the Node's counts; retrying" + hint, error=str(exc))
                self.last_error = str(exc)
                self._kick.set()
                await self._sleep(self._backoff.delay(attempt))
                continue
            if self.last_error:
                log.info("the Node's counts can be lowered again")
            attempt = 0
            self.last_error = ""

    async def _wait(self) -> None:
        now = self._clock()
        timeout = POLL_S if now < self._fast_until else SLOW_POLL_S if now < self._watch_until else None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._kick.wait()
        self._kick.clear()

    async def _check(self) -> None:
        ceilings = dict(self._ceilings)
        if not ceilings:
            return
        self.reads += 1
        params = None if self._fresh else {"resourceVersion": "0"}
        node = await self._client.get(self._path, params, timeout_s=TIMEOUT_S, max_bytes=NODE_MAX_BYTES)
        self._fresh = False
        seen_at = self._clock()
        status = node.get("status")
        capacity: dict[str, str] = {}
        allocatable: dict[str, str] = {}
        for name, ceiling in ceilings.items():
            alloc = _count(status, "allocatable", name)
            if alloc is None or alloc <= ceiling.allocatable:
                self._held.setdefault(name, seen_at)
                continue
            self._held.pop(name, None)
            allocatable[name] = str(ceiling.allocatable)
            cap = _count(status, "capacity", name)
            if cap is not None and cap > ceiling.capacity:
                capacity[name] = str(ceiling.capacity)
        if not allocatable:
            return
        body: dict[str, Any] = {"status": {"allocatable": allocatable}}
        version = node.get("metadata", {}).get("resourceVersion")
        if isinstance(version, str) and version:
            body["metadata"] = {"resourceVersion": version}
        if capacity:
            body["status"]["capacity"] = capacity
        try:
            await self._client.patch(f"{self._path}/status", body)
        except KubeConflictError:
            # the kubelet (or someone) wrote meanwhile: read again, from etcd, at once
            self.conflicts += 1
            self._fresh = True
            self._kick.set()
            return
        self.patches += 1
        done = self._clock()
        for name in allocatable:
            if self._ceilings.get(name) == ceilings[name]:
                self._held[name] = done
        self.last_patch = {"allocatable": allocatable, "capacity": capacity}
        log.info("lowered the Node's counts for the scheduler", allocatable=allocatable, capacity=capacity)
