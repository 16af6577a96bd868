"""Read a pod's ResourceClaims when the pod is bound to this node, before the kubelet asks.

The kubelet calls NodePrepareResources late in a pod's start: after it has seen the pod bound,
admitted it and mounted its volumes (``pkg/kubelet/kuberuntime/kuberuntime_manager.go``,
``SyncPod``: resources are prepared right before the sandbox is created), tens to hundreds of
milliseconds after the binding. Preparation itself starts with a GET of every claim (as the Go
``kubeletplugin`` helper does), which on a loaded node was a third of a one-claim prepare.

The agent watches this node's pods anyway (``agent/kube/pods.py``). :class:`ClaimPrefetch` is the
driver's :class:`ClaimSource`: when the watch shows a pod *arriving* on the node (an ``ADDED``
event of a pod that has not started), it starts the GET of each claim the pod names, and a
prepare that asks for one of them takes the answer of that GET instead of making its own. The
number of requests does not change (the GET is made earlier, not twice).

A prefetched claim is used only when it is what a GET made now would give for this purpose:

* the claim has the UID the kubelet asked for and is allocated;
* it is reserved for the pod whose arrival started the read: the scheduler allocates and reserves
  a claim before it binds the pod, so a read made after the binding sees the allocation the
  kubelet prepares, and an allocation only goes away once no pod is reserved any more;
* the pod is still on the node (its deletion drops its reads), no other pod arrived naming the
  same claim since (its arrival starts a new read), and the read is at most ``ttl_s`` old.

Anything else, a read that failed included, falls back to a GET made then. Each read is used at
most once. Bounds: ``max_entries`` reads kept (the oldest go first), ``max_inflight`` GETs at a
time (more arrivals than that are simply not prefetched), ``max_claims`` claims per pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from agent.kube.claims.model import ClaimRef, ClaimSource, ResourceClaim
from agent.kube.podclaims import MAX_CLAIMS, pod_claims

log = structlog.get_logger("agent.kube")

#: reads kept; a node starts far fewer claims than this within ``TTL_S``
MAX_ENTRIES = 256
#: reads in flight at a time
MAX_INFLIGHT = 16
#: a read older than this is not used (the kubelet normally asks within a second of the binding)
TTL_S = 60.0
#: pods in these phases have started (or finished): their claims are prepared already
_STARTED = ("Running", "Succeeded", "Failed")

Clock = Callable[[], float]


@dataclass(slots=True)
class _Read:
    pod_uid: str
    started: float
    task: asyncio.Task[ResourceClaim | None]


class ClaimPrefetch:
    def __init__(
        self,
        source: ClaimSource,
        *,
        max_entries: int = MAX_ENTRIES,
        max_inflight: int = MAX_INFLIGHT,
        ttl_s: float = TTL_S,
        clock: Clock = time.monotonic,
    ) -> None:
        self._source = source
        self._max_entries = max_entries
        self._max_inflight = max_inflight
        self._ttl_s = ttl_s
        self._clock = clock
        #: (namespace, claim name) -> the read started for it, oldest first
        self._reads: OrderedDict[tuple[str, str], _Read] = OrderedDict()
        self._inflight = 0
        #: (namespace, claim name) -> whether the claim is prepared here already (set by DRA)
        self._prepared: Callable[[str, str], bool] = lambda namespace, name: False
        self.started = 0
        self.used = 0
        self.not_used = 0
        self.skipped = 0

    def skip_prepared(self, prepared: Callable[[str, str], bool]) -> None:
        """Claims for which ``prepared(namespace, name)`` is true are not read ahead (a pod that
        shares a claim prepared already: the kubelet's Prepare is answered without a read)."""
        self._prepared = prepared

    # --- the pod watch's side ---------------------------------------------------------------

    def pod_added(self, pod: Any) -> None:
        """A pod arrived on the node (the watch's ADDED): read the claims it names."""
        status = pod.get("status") if isinstance(pod, dict) else None
        if isinstance(status, dict) and status.get("phase") in _STARTED:
            return
        claims = pod_claims(pod)
        if claims is None:
            return
        for name in claims.claims[:MAX_CLAIMS]:
            self._start(claims.namespace, name, claims.uid)

    def pod_deleted(self, pod: Any) -> None:
        """A pod left the node: reads it started are not used."""
        claims = pod_claims(pod, finished=True)
        if claims is None:
            return
        for name in claims.claims:
            key = (claims.namespace, name)
            read = self._reads.get(key)
            if read is not None and read.pod_uid == claims.uid:
                self._drop(key)

    def _start(self, namespace: str, name: str, pod_uid: str) -> None:
        key = (namespace, name)
        if self._prepared(namespace, name):
            return
        if key in self._reads:
            self._drop(key)  # another pod names the claim now: what it was read for is over
        if self._inflight >= self._max_inflight:
            self.skipped += 1
            return
        while len(self._reads) >= self._max_entries:
            self._drop(next(iter(self._reads)))
        task = asyncio.create_task(
            self._source.get_claim(ClaimRef(namespace, name, "")), name=f"claim-prefetch {namespace}/{name}"
        )
        self._inflight += 1
        task.add_done_callback(self._finished)
        self._reads[key] = _Read(pod_uid=pod_uid, started=self._clock(), task=task)
        self.started += 1

    def _finished(self, task: asyncio.Task[ResourceClaim | None]) -> None:
        self._inflight -= 1

    def _drop(self, key: tuple[str, str]) -> None:
        read = self._reads.pop(key)
        if not read.task.done():
            read.task.cancel()
        else:
            _consume(read.task)

    # --- preparation's side -----------------------------------------------------------------

    async def get_claim(self, ref: ClaimRef) -> ResourceClaim | None:
        """The prefetched claim when it may be used (see the module docstring), else a GET now."""
        read = self._reads.pop((ref.namespace, ref.name), None)
        if read is not None:
            claim = await self._settle(read)
            if claim is not None and _usable(claim, ref, read.pod_uid):
                self.used += 1
                return claim
            self.not_used += 1
        return await self._source.get_claim(ref)

    async def _settle(self, read: _Read) -> ResourceClaim | None:
        if self._clock() - read.started > self._ttl_s:
            if not read.task.done():
                read.task.cancel()
            else:
                _consume(read.task)
            return None
        try:
            return await read.task  # each read is used once: a caller that gives up cancels it
        except asyncio.CancelledError:
            raise
        except Exception:  # the read failed: the GET made now says why, if it fails again
            return None

    async def run(self) -> None:
        """Wait until cancelled (shutdown), then cancel the reads in flight."""
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()

    async def close(self) -> None:
        """Cancel the reads in flight (shutdown)."""
        tasks = [read.task for read in self._reads.values()]
        self._reads.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    def debug_state(self) -> dict[str, object]:
        return {
            "kept": len(self._reads),
            "in_flight": self._inflight,
            "started": self.started,
            "used": self.used,
            "not_used": self.not_used,
            "skipped": self.skipped,
        }


def _usable(claim: ResourceClaim, ref: ClaimRef, pod_uid: str) -> bool:
    return claim.uid == ref.uid and claim.allocated and any(p.uid == pod_uid for p in claim.reserved_for)


def _consume(task: asyncio.Task[ResourceClaim | None]) -> None:
    """Retrieve a finished read's exception, so that asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()
