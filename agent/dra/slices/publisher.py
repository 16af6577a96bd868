"""Keeps this node's ResourceSlices equal to what the node can offer through DRA.

:class:`KubeSlicePublisher` runs three things on the loop until cancelled:

* a *feed* task per change source (inventory, ownership, health) that kicks a sync;
* a *watch* on our own slices (field selector ``spec.nodeName=<node>,spec.driver=<driver>``)
  that keeps :attr:`_slices`, the server's slices as last seen, and kicks a sync when they
  change under us (the kubelet deletes every slice of the node when it starts, and a driver's
  slices 30 s after the driver goes away);
* the *sync* loop, the only writer: it computes the desired pool (``agent/dra/slices/plan.py``),
  compares it with :attr:`_slices` and writes only the difference. Errors never escape: a
  conflict re-reads and retries, an outage backs off exponentially (1 s to 30 s, each delay drawn
  from half to one and a half of it, so a fleet does not retry in step), and the last error shows
  on ``/readyz`` and ``/debug/state``.

Device taints are used only where the cluster keeps them: the first time a device is unhealthy,
a dry-run create with a tainted device shows whether the server drops the field (gate
``DRADeviceTaints`` off); every real write is checked the same way. The answer is kept per
``resource.k8s.io`` version and found again after a re-discovery.

:meth:`KubeSlicePublisher.published_gpus` is what the handover checks against the device plugin's
ListAndWatch: a GPU counts as published from the moment a write that includes it is attempted
until a write without it has succeeded. Before the first successful list (the API server was
unreachable since start) every GPU of the node counts as published: a slice from an earlier
run may still name it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from agent.base.backoff import Backoff
from agent.base.feeds import Subscription
from agent.core.mechanism import Readiness
from agent.core.node import NodeFacts
from agent.dra.devices import dra_devices
from agent.dra.slices.codec import parse_slice, slice_body
from agent.dra.slices.plan import (
    Plan,
    SliceDevice,
    StoredSlice,
    Taint,
    desired_slices,
    generate_name,
    plan,
    taint_key,
    unhealthy_cause,
)
from agent.kube.client import METADATA_ACCEPT, KubeClient
from agent.kube.discovery import ResourceApi
from agent.kube.errors import KubeConflictError, KubeError, KubeGoneError, KubeNotFoundError
from agent.kube.listwatch import WATCH_BACKOFF

log = structlog.get_logger("agent.dra.slices")

RESOURCE = "resourceslices"
Sleep = Callable[[float], Awaitable[None]]
#: server-side outcomes of a write we could not see (timeout, broken connection) are "maybe"
_UNKNOWN_OUTCOME = None


class SliceMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.writes = Counter(
            "gpu_agent_dra_slice_writes_total", "ResourceSlice writes by action", ["action"], registry=registry
        )
        self.write_errors = Counter(
            "gpu_agent_dra_slice_write_errors_total",
            "ResourceSlice writes that failed, by action",
            ["action"],
            registry=registry,
        )
        for action in ("create", "update", "delete"):
            self.writes.labels(action=action)
            self.write_errors.labels(action=action)
        self.devices = Gauge(
            "gpu_agent_dra_published_devices", "Devices in this node's ResourceSlices", registry=registry
        )
        self.generation = Gauge(
            "gpu_agent_dra_pool_generation", "Generation of this node's ResourceSlice pool", registry=registry
        )
        self.last_write = Gauge(
            "gpu_agent_dra_slice_last_write_timestamp_seconds",
            "Unix time of the last successful ResourceSlice write",
            registry=registry,
        )
        self.slices = Gauge(
            "gpu_agent_dra_resource_slices", "ResourceSlices of this node's pool on the API server", registry=registry
        )
        self.sync_seconds = Histogram(
            "gpu_agent_dra_slice_sync_duration_seconds",
            "One ResourceSlice reconcile pass (compare, then write the difference), by result",
            ["result"],
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
        )


class KubeSlicePublisher:
    def __init__(
        self,
        *,
        client: KubeClient,
        node_name: str,
        driver_name: str,
        node: NodeFacts,
        registry: CollectorRegistry | None = None,
        resource_api: ResourceApi | None = None,
        backoff: Backoff | None = None,
        sleep: Sleep = asyncio.sleep,
        watch_timeout_s: float = 300.0,
        min_watch_s: float = 1.0,
    ) -> None:
        self._client = client
        self.node_name = node_name
        self.driver_name = driver_name
        self._inventory = node.inventory
        self._ownership = node.ownership
        self._health = node.health
        self._api = resource_api or ResourceApi(client)
        #: retries of writes and of the watch, with wide jitter: after an API server restart every
        #: node's publisher retries at once
        self._backoff = backoff or WATCH_BACKOFF
        self._sleep = sleep
        self._watch_timeout_s = watch_timeout_s
        self._min_watch_s = min_watch_s
        self._metrics = SliceMetrics(registry)
        self._kicked = asyncio.Event()
        self._kicked.set()
        #: the server's slices of our pool, as last listed, watched or written (name -> slice)
        self._slices: dict[str, StoredSlice] = {}
        #: a list has succeeded, so ``_slices`` is the server's truth as far as the watch keeps it
        self._known = False
        #: relist before the next plan (after a conflict or a vanished slice)
        self._stale = True
        self._watch_rv = ""
        self._node_uid = ""
        #: resource.k8s.io version -> whether the server keeps device taints
        self._taints: dict[str, bool] = {}
        #: desired slice content -> what the server stored for it, when the two differ
        self._normalized: dict[tuple[SliceDevice, ...], tuple[SliceDevice, ...]] = {}
        self._inflight: frozenset[str] = frozenset()
        #: GPUs of writes whose outcome was not seen; cleared by the next successful list
        self._uncertain: set[str] = set()
        self._generation = 0
        self._synced = False
        self.last_error = ""
        self.last_write = ""
        self.writes = dict.fromkeys(("create", "update", "delete"), 0)
        self.errors = 0
        self.syncs = 0

    # --- the interface the DRA mechanism uses ------------------------------------------

    def kick(self) -> None:
        """Compare and publish soon (e.g. after a handover granted or released a GPU)."""
        self._kicked.set()

    def published_gpus(self) -> frozenset[str]:
        """Physical GPU UUIDs that the scheduler may see in one of our slices now or soon."""
        gpus = set(self._inflight) | self._uncertain
        for stored in self._slices.values():
            gpus |= stored.gpus
        if not self._known:
            gpus |= {d.gpu_uuid for d in dra_devices(self._inventory.current)}
        return frozenset(gpus)

    def resync(self) -> None:
        """List the slices again before the next comparison, and compare now (the watchdog's repair:
        our view of the server may be what is wrong)."""
        self._stale = True
        self.kick()

    def slice_check(self) -> tuple[frozenset[str], frozenset[str]] | None:
        """(device names the pool should hold, device names our slices hold as last seen), or None
        while either is unknown (no successful list yet; taint support unknown with an unhealthy device)."""
        version = self._api.current
        if not self._known or not version:
            return None
        desired = self._desired(version)
        if desired is None:
            return None
        expected = frozenset(d.name for devices in desired for d in devices)
        return expected, frozenset(d.name for s in self._slices.values() for d in s.devices)

    def readiness(self) -> Readiness:
        if self._synced and not self.last_error:
            devices = sum(len(s.devices) for s in self._slices.values())
            return Readiness(
                True,
                f"{devices} devices in {len(self._slices)} ResourceSlices, generation {self._generation} "
                f"(resource.k8s.io/{self._api.current})",
            )
        return Readiness(False, f"ResourceSlices not published: {self.last_error or 'no answer from the API yet'}")

    def debug_state(self) -> dict[str, object]:
        version = self._api.current
        return {
            "api_version": f"resource.k8s.io/{version}" if version else None,
            "pool": self.node_name,
            "driver": self.driver_name,
            "generation": self._generation,
            "slices": [
                {"name": s.name, "generation": s.generation, "devices": [d.name for d in s.devices]}
                for s in sorted(self._slices.values(), key=lambda s: s.name)
            ],
            "devices_published": sum(len(s.devices) for s in self._slices.values()),
            "gpus_published": sorted(self.published_gpus()),
            "server_state_known": self._known,
            "last_write": self.last_write or None,
            "last_error": self.last_error or None,
            "writes": dict(self.writes),
            "errors": self.errors,
            "taints_supported": self._taints.get(version) if version else None,
        }

    # --- running -------------------------------------------------------------------------

    async def run(self) -> None:
        """Publish until cancelled. A node without GPUs talks to nobody until GPUs appear."""
        with (
            self._inventory.changes.subscribe() as inventory,
            self._ownership.changes.subscribe() as ownership,
            self._health.changes.subscribe() as health,
        ):
            while not self._inventory.current.gpus:
                await inventory.get()
            async with asyncio.TaskGroup() as group:
                for name, feed in (("inventory", inventory), ("ownership", ownership), ("health", health)):
                    group.create_task(self._follow(feed), name=f"dra-slices-feed-{name}")
                group.create_task(self._watch_loop(), name="dra-slices-watch")
                group.create_task(self._sync_loop(), name="dra-slices-sync")

    async def _follow(self, feed: Subscription[Any]) -> None:
        async for _ in feed:
            self.kick()

    async def _sync_loop(self) -> None:
        attempt = 0
        while True:
            await self._kicked.wait()
            self._kicked.clear()
            started = time.monotonic()
            try:
                await self._sync()
            except KubeError as exc:
                self._metrics.sync_seconds.labels(result="error").observe(time.monotonic() - started)
                attempt += 1
                self._failed(exc)
                self._kicked.set()  # try again after the backoff, kicked or not
                await self._sleep(self._backoff.delay(attempt))
                continue
            self._metrics.sync_seconds.labels(result="ok").observe(time.monotonic() - started)
            attempt = 0
            self._synced = True
            if self.last_error:
                log.info("ResourceSlices published again", node=self.node_name)
                self.last_error = ""

    def _failed(self, exc: KubeError) -> None:
        self.errors += 1
        if exc.status is None or isinstance(exc, KubeConflictError | KubeNotFoundError):
            # a conflict, a vanished slice, or a write whose outcome was not seen: read before writing
            self._stale = True
        if self.last_error != str(exc):
            log.warning("ResourceSlice sync failed; retrying with backoff", node=self.node_name, error=str(exc))
        self.last_error = str(exc)

    # --- one sync ------------------------------------------------------------------------

    async def _sync(self) -> None:
        self.syncs += 1
        try:
            version = await self._api.version()
        except KubeError as exc:
            if exc.status == 404:
                # the group is not served: nothing of ours can be in a slice
                self._slices.clear()
                self._known = True
            raise
        node_uid = await self._node_uid_of()
        if self._stale or not self._known:
            await self._relist(version)
        desired = self._desired(version)
        if desired is None:
            await self._probe_taints(version, node_uid)
            desired = self._desired(version)
            assert desired is not None
        current = plan(
            [self._normalized.get(d, d) for d in desired],
            list(self._slices.values()),
            node=self.node_name,
            driver=self.driver_name,
            node_uid=node_uid,
            last_generation=self._generation,
        )
        self._generation = current.generation
        self._metrics.generation.set(current.generation)
        if current.empty:
            return
        log.info(
            "publishing ResourceSlices",
            node=self.node_name,
            generation=current.generation,
            slices=current.count,
            devices=sum(len(d) for d in desired),
            why="; ".join(current.reasons),
        )
        await self._apply(version, node_uid, current, desired)

    def _desired(self, version: str) -> tuple[tuple[SliceDevice, ...], ...] | None:
        """The pool's slices; None when a device is unhealthy and taint support is not known yet."""
        return desired_slices(
            dra_devices(self._inventory.current),
            ownership=self._ownership.current,
            health=self._health,
            driver=self.driver_name,
            taints=self._taints.get(version),
        )

    async def _apply(
        self, version: str, node_uid: str, current: Plan, desired: tuple[tuple[SliceDevice, ...], ...]
    ) -> None:
        # obsolete slices go first: devices the node no longer offers disappear even if a create fails
        for stored in current.deletes:
            await self._delete(version, stored)
        wanted = {self._normalized.get(d, d): d for d in desired}
        for stored, devices in current.updates:
            await self._write(version, node_uid, current, wanted.get(devices, devices), stored)
        for devices in current.creates:
            await self._write(version, node_uid, current, wanted.get(devices, devices), None)

    async def _write(
        self, version: str, node_uid: str, current: Plan, devices: tuple[SliceDevice, ...], stored: StoredSlice | None
    ) -> None:
        action = "create" if stored is None else "update"
        body = slice_body(
            version,
            node=self.node_name,
            node_uid=node_uid,
            driver=self.driver_name,
            generation=current.generation,
            count=current.count,
            devices=devices,
            name=stored.name if stored else "",
            generate_name=generate_name(self.node_name, self.driver_name),
            resource_version=stored.resource_version if stored else "",
        )
        gpus = frozenset(d.gpu_uuid for d in devices if d.gpu_uuid)
        self._inflight = gpus
        collection = self._api.path(version, RESOURCE)
        try:
            if stored is None:
                answer = await self._client.create(collection, body)
            else:
                answer = await self._client.replace(self._api.path(version, RESOURCE, name=stored.name), body)
        except KubeError as exc:
            self._metrics.write_errors.labels(action=action).inc()
            if exc.status is _UNKNOWN_OUTCOME:
                self._uncertain |= gpus
            if isinstance(exc, KubeNotFoundError) and not exc.object_missing:
                self._api.forget(version)
            raise
        finally:
            self._inflight = frozenset()
        self._count_write(action)
        written = self._parse(answer, version)
        self._slices[written.name] = written
        self._check_stored(version, devices, written)

    async def _delete(self, version: str, stored: StoredSlice) -> None:
        options: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if stored.uid and stored.resource_version:
            options["preconditions"] = {"uid": stored.uid, "resourceVersion": stored.resource_version}
        try:
            await self._client.delete(self._api.path(version, RESOURCE, name=stored.name), options)
        except KubeNotFoundError as exc:
            if not exc.object_missing:
                self._api.forget(version)
                raise
        except KubeError:
            self._metrics.write_errors.labels(action="delete").inc()
            raise
        else:
            self._count_write("delete")
        self._slices.pop(stored.name, None)

    def _count_write(self, action: str) -> None:
        self.writes[action] += 1
        self._metrics.writes.labels(action=action).inc()
        self._metrics.last_write.set(time.time())
        self.last_write = datetime.now(UTC).isoformat(timespec="milliseconds")
        self._update_gauges()

    def _update_gauges(self) -> None:
        self._metrics.devices.set(sum(len(s.devices) for s in self._slices.values()))
        self._metrics.slices.set(len(self._slices))

    def _check_stored(self, version: str, sent: tuple[SliceDevice, ...], stored: StoredSlice) -> None:
        """Notice fields the server dropped (a disabled gate) or changed, so the next plan agrees with it."""
        self._update_gauges()
        if stored.devices == sent:
            return
        if any(d.taints for d in sent) and not any(d.taints for d in stored.devices):
            log.warning(
                "the API server dropped device taints (DRADeviceTaints is off); unhealthy devices leave the slice",
                version=version,
            )
            self._taints[version] = False
            self.kick()
            return
        log.warning("the API server stored a ResourceSlice other than sent; keeping its form", slice=stored.name)
        if len(self._normalized) > 64:
            self._normalized.clear()
        self._normalized[sent] = stored.devices

    async def _probe_taints(self, version: str, node_uid: str) -> None:
        """Ask with a dry-run create whether the server keeps a device's taint."""
        probe = next(
            (d for d in dra_devices(self._inventory.current) if unhealthy_cause(self._health, d.uuid) is not None), None
        )
        assert probe is not None
        device = SliceDevice.of(probe, (Taint(taint_key(self.driver_name), "probe"),))
        body = slice_body(
            version,
            node=self.node_name,
            node_uid=node_uid,
            driver=self.driver_name,
            generation=max(self._generation, 1),
            count=1,
            devices=(device,),
            generate_name=generate_name(self.node_name, self.driver_name),
        )
        answer = await self._client.create(self._api.path(version, RESOURCE), body, {"dryRun": "All"})
        kept = any(d.taints for d in self._parse(answer, version).devices)
        self._taints[version] = kept
        log.info("device taint support detected", version=version, supported=kept)

    # --- reading -------------------------------------------------------------------------

    async def _node_uid_of(self) -> str:
        if not self._node_uid:
            node = await self._client.get(f"/api/v1/nodes/{quote(self.node_name, safe='')}", accept=METADATA_ACCEPT)
            metadata = node.get("metadata")
            uid = metadata.get("uid") if isinstance(metadata, dict) else None
            if not isinstance(uid, str) or not uid:
                raise KubeError(f"node {self.node_name!r}: the API server's answer has no metadata.uid")
            self._node_uid = uid
        return self._node_uid

    def _selector(self) -> dict[str, str]:
        return {"fieldSelector": f"spec.nodeName={self.node_name},spec.driver={self.driver_name}"}

    async def _relist(self, version: str) -> str:
        """List our slices into ``_slices``; returns the list's resourceVersion."""
        try:
            body = await self._client.list(self._api.path(version, RESOURCE), self._selector())
        except KubeNotFoundError as exc:
            if not exc.object_missing:
                self._api.forget(version)
            raise
        items = body.get("items")
        if not isinstance(items, list):
            raise KubeError(f"list {RESOURCE}: the answer has no items list", recoverable=True)
        slices = [self._parse(item, version) for item in items]
        self._slices = {s.name: s for s in slices if s.name}
        self._known, self._stale = True, False
        self._uncertain.clear()
        self._update_gauges()
        metadata = body.get("metadata")
        return str(metadata.get("resourceVersion") or "") if isinstance(metadata, dict) else ""

    def _parse(self, obj: Any, version: str) -> StoredSlice:
        """A slice as stored; one whose shape is not a slice's becomes an obsolete entry (deleted)."""
        try:
            return parse_slice(obj, version)
        except ValueError as exc:
            metadata = obj.get("metadata") if isinstance(obj, dict) else None
            metadata = metadata if isinstance(metadata, dict) else {}
            log.warning("malformed ResourceSlice from the API server", error=str(exc), name=metadata.get("name"))
            return StoredSlice(
                name=str(metadata.get("name") or ""),
                uid=str(metadata.get("uid") or ""),
                resource_version=str(metadata.get("resourceVersion") or ""),
                driver="",
                pool="",
                generation=-1,
                count=0,
                node_name="",
                devices=(),
            )

    async def _watch_loop(self) -> None:
        attempt = 0
        while True:
            version = ""
            started = time.monotonic()
            events = 0
            try:
                version = await self._api.version()
                if not self._watch_rv:
                    self._watch_rv = await self._relist(version)
                    self.kick()
                async with contextlib.aclosing(self._events(version)) as stream:
                    async for event in stream:
                        events += 1
                        attempt = 0
                        self._on_event(event, version)
            except KubeGoneError:
                # list again, after a backoff: every node hears this at once when an API server restarts
                self._watch_rv = ""
                attempt += 1
                await self._sleep(self._backoff.delay(attempt))
                continue
            except KubeError as exc:
                if isinstance(exc, KubeNotFoundError) and not exc.object_missing and version:
                    self._api.forget(version)
                self._watch_rv = "" if exc.status == 404 else self._watch_rv
                log.debug("ResourceSlice watch failed", error=str(exc))
                attempt += 1
                await self._sleep(self._backoff.delay(attempt))
                continue
            if events == 0 and time.monotonic() - started < self._min_watch_s:
                attempt += 1  # a stream that ends at once is no progress: do not spin
                await self._sleep(self._backoff.delay(attempt))

    def _events(self, version: str) -> AsyncGenerator[dict[str, Any], None]:
        params = {**self._selector(), "resourceVersion": self._watch_rv, "allowWatchBookmarks": "true"}
        # a timeout drawn per stream (1 to 2 times the minimum, as client-go's reflector does): the
        # streams of a fleet started together do not all end together
        timeout_s = self._watch_timeout_s * (1.0 + random.random())
        return self._client.watch(self._api.path(version, RESOURCE), params, timeout_s=timeout_s)

    def _on_event(self, event: dict[str, Any], version: str) -> None:
        kind, obj = event["type"], event["object"]
        metadata = obj.get("metadata")
        rv = str(metadata.get("resourceVersion") or "") if isinstance(metadata, dict) else ""
        self._watch_rv = rv or self._watch_rv
        if kind == "BOOKMARK":
            return
        stored = self._parse(obj, version)
        if kind == "DELETED":
            if self._slices.pop(stored.name, None) is not None:
                log.info("ResourceSlice deleted by someone else", slice=stored.name)
                self.kick()
            return
        known = self._slices.get(stored.name)
        if known is not None and _older(stored.resource_version, known.resource_version):
            return  # the answer to our own write already told us more
        if known != stored:
            self._slices[stored.name] = stored
            self.kick()


def _older(a: str, b: str) -> bool:
    """Whether resourceVersion ``a`` is older than ``b`` (only when both are numbers, as etcd's are)."""
    return a.isdigit() and b.isdigit() and int(a) < int(b)
