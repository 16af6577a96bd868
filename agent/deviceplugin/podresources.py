"""The kubelet's PodResources API: which containers hold which device-plugin devices.

The device plugin cannot see what the kubelet did with the devices it advertised; PodResources
(``<kubelet root>/pod-resources/kubelet.sock``, ``v1.PodResourcesLister``) can. :class:`PodResourcesWatcher`
asks ``List`` about once a second (the kubelet allows 100 calls/s) and ``GetAllocatableResources``
now and then where it is served, and keeps the newest answer. A missing socket, a failing or slow
call means *unknown*, never "nothing in use": the watcher says why in ``last_error`` and the
handover waits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import structlog
from grpclib import GRPCError
from grpclib.client import Channel
from grpclib.const import Status

from agent._proto.podresources_v1 import v1 as pb

log = structlog.get_logger("agent.plugin.podresources")
T = TypeVar("T")

#: how long one call may take; the kubelet answers in milliseconds
CALL_TIMEOUT_S = 2.0
#: the newest answer is at most about this old while the kubelet answers
POLL_S = 1.0
#: the same while a GPU drains away from the device plugin (a handover waits for a fresh answer)
FAST_POLL_S = 0.25
#: how often GetAllocatableResources is asked (it changes only with ListAndWatch updates)
ALLOCATABLE_EVERY_S = 10.0
#: a kubelet answer with more containers than this is cut (a node runs at most a few hundred pods)
MAX_CONTAINERS = 10_000


class PodResourcesError(Exception):
    """The kubelet's PodResources API could not answer; one line."""


@dataclass(frozen=True, slots=True)
class ContainerDevices:
    """One container's devices of one resource, as the kubelet lists them."""

    namespace: str
    pod: str
    container: str
    resource_name: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One ``List`` answer (device-plugin devices only) and when it was asked for."""

    containers: tuple[ContainerDevices, ...]
    #: monotonic time the call was sent: everything allocated before then is in the answer
    as_of: float
    #: resource name -> allocatable device IDs, when GetAllocatableResources is served
    allocatable: dict[str, tuple[str, ...]] | None = None
    truncated: bool = False


class PodResourcesClient:
    """One call at a time on the kubelet's socket; a new connection per call (the socket may move)."""

    def __init__(self, socket: Path, *, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.socket = socket
        self._timeout_s = timeout_s
        #: False once the kubelet said GetAllocatableResources is not served
        self.allocatable_served = True

    async def list(self) -> tuple[list[ContainerDevices], bool]:
        """Every container's device-plugin devices, and whether the answer was cut."""
        response = await self._call(lambda stub: stub.list(pb.ListPodResourcesRequest(), timeout=self._timeout_s))
        out: list[ContainerDevices] = []
        truncated = False
        for pod in response.pod_resources:
            for container in pod.containers:
                for devices in container.devices:
                    if len(out) >= MAX_CONTAINERS:
                        truncated = True
                        break
                    out.append(
                        ContainerDevices(
                            namespace=pod.namespace,
                            pod=pod.name,
                            container=container.name,
                            resource_name=devices.resource_name,
                            device_ids=tuple(devices.device_ids),
                        )
                    )
        return out, truncated

    async def allocatable(self) -> dict[str, tuple[str, ...]] | None:
        """Allocatable device IDs per resource; None where the kubelet does not serve the call."""
        if not self.allocatable_served:
            return None
        try:
            response = await self._call(
                lambda stub: stub.get_allocatable_resources(pb.AllocatableResourcesRequest(), timeout=self._timeout_s)
            )
        except _Unimplemented:
            self.allocatable_served = False
            return None
        out: dict[str, list[str]] = {}
        for devices in response.devices:
            out.setdefault(devices.resource_name, []).extend(devices.device_ids)
        return {name: tuple(ids) for name, ids in out.items()}

    async def _call(self, call: Callable[[pb.PodResourcesListerStub], Awaitable[T]]) -> T:
        try:
            self.socket.lstat()
        except FileNotFoundError:
            raise PodResourcesError(f"no PodResources socket at {self.socket} (is the kubelet running?)") from None
        except OSError as exc:  # an unreadable kubelet directory (not root), a file in the way
            raise PodResourcesError(f"cannot look for the PodResources socket {self.socket}: {exc.strerror}") from exc
        channel = Channel(path=str(self.socket))
        try:
            return await call(pb.PodResourcesListerStub(channel))
        except GRPCError as exc:
            if exc.status is Status.UNIMPLEMENTED:
                raise _Unimplemented from exc
            message = " ".join(str(exc.message or "").split())[:200]
            raise PodResourcesError(f"PodResources on {self.socket}: {exc.status.name}: {message}") from exc
        except (OSError, TimeoutError) as exc:
            raise PodResourcesError(f"PodResources on {self.socket}: {type(exc).__name__}: {exc}") from exc
        finally:
            channel.close()


class _Unimplemented(Exception):
    pass


@dataclass
class PodResourcesWatcher:
    """Keeps the newest PodResources answer; never raises."""

    client: PodResourcesClient
    poll_s: float = POLL_S
    fast_poll_s: float = FAST_POLL_S
    #: whether an answer is wanted soon (the device plugin sets it: a GPU drains away from it)
    urgent: Callable[[], bool] = field(default=lambda: False, repr=False)
    allocatable_every_s: float = ALLOCATABLE_EVERY_S
    clock: Callable[[], float] = time.monotonic
    latest: Snapshot | None = None
    last_error: str = "no answer from the kubelet's PodResources API yet"
    calls: int = 0
    failures: int = 0
    _allocatable: dict[str, tuple[str, ...]] | None = field(default=None, repr=False)
    _allocatable_at: float = field(default=float("-inf"), repr=False)

    @property
    def known(self) -> bool:
        """The newest call succeeded (an older answer is not trusted once a call failed)."""
        return self.latest is not None and not self.last_error

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.fast_poll_s if self.urgent() else self.poll_s)

    async def poll(self) -> None:
        """One List (and, when due, one GetAllocatableResources); the result or the reason is kept."""
        started = self.clock()
        self.calls += 1
        try:
            containers, truncated = await self.client.list()
            if started - self._allocatable_at >= self.allocatable_every_s:
                self._allocatable = await self.client.allocatable()
                self._allocatable_at = started
        except PodResourcesError as exc:
            self.failures += 1
            if str(exc) != self.last_error:
                log.warning("cannot tell which pods hold GPUs", error=str(exc))
            self.last_error = str(exc)
            return
        if self.last_error and self.latest is not None:
            log.info("PodResources answers again")
        self.last_error = ""
        self.latest = Snapshot(
            containers=tuple(containers), as_of=started, allocatable=self._allocatable, truncated=truncated
        )
        if truncated:
            log.warning("PodResources answer cut", containers=MAX_CONTAINERS)
