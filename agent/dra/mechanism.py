"""DRA as one mechanism (:class:`agent.core.mechanism.Mechanism`): kubelet plugin, health stream,
claim preparation with its checkpoint, and the ResourceSlice publisher, run together.

The composition root builds it with :func:`build_dra` (which loads the checkpoint and tells
the CDI service which claim specs are legitimate *before* the CDI reconciler's first pass,
so a restart never deletes the spec of a prepared claim) and runs :meth:`DraMechanism.run`.
The publisher is injected: it owns the ResourceSlices and the API client; this package only
knows it through :class:`SlicePublisher`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog
from prometheus_client import CollectorRegistry

from agent.base.backoff import Backoff
from agent.base.errors import StartupError
from agent.cdi.service import CdiProvider
from agent.core.config.schema import Config, Owner
from agent.core.mechanism import Holder, NodeStatus, Readiness, RegistrationCheck, SchedulerView, Usage
from agent.core.node import NodeFacts
from agent.core.ownership.table import OwnershipState
from agent.core.partitioning import MigControl, MpsControl
from agent.dra.claims.allocated import AllocatedClaims, PodClaimLister
from agent.dra.claims.checkpoint import CheckpointStore, read_boot_id
from agent.dra.claims.driver import DEFAULT_PREPARE_TIMEOUTS, DraDriver, PrepareTimeouts
from agent.dra.claims.holders import add_claim
from agent.dra.claims.prepared import PreparedClaims
from agent.dra.claims.specwriter import ClaimSpecWriter, specs_to_keep
from agent.dra.kubelet.endpoints import (
    DRA_SOCKET,
    REGISTRY_DIR,
    SERVE_BACKOFF,
    KubeletPlugin,
    registration_socket_name,
)
from agent.dra.kubelet.health_servicer import HealthServicer
from agent.dra.kubelet.healthfeed import RESEND_S, HealthFeed
from agent.dra.kubelet.registration import RegistrationState
from agent.dra.kubelet.registration_servicer import RegistrationServicer
from agent.dra.kubelet.servicer import v1_servicer, v1beta1_servicer
from agent.dra.metrics import DraMetrics, PartitionCollector
from agent.dra.modes import ModeGate
from agent.dra.occupancy import occupancy
from agent.kube.claims.model import ClaimSource

log = structlog.get_logger("agent.dra")


class SlicePublisher(Protocol):
    """What the DRA mechanism needs of the ResourceSlice publisher: :class:`KubeSlicePublisher
    <agent.dra.slices.publisher.KubeSlicePublisher>` (through the API), :class:`NoApiPublisher
    <agent.dra.slices.noapi.NoApiPublisher>` (without API access), a fake in tests."""

    async def run(self) -> None:
        """Publish and keep the node's slices current until cancelled."""
        ...

    def published_gpus(self) -> frozenset[str]:
        """Physical GPU UUIDs that currently have a device in a published slice."""
        ...

    def kick(self) -> None:
        """Look again now (the kubelet (re)registered the plugin: it may have wiped the slices)."""
        ...

    def resync(self) -> None:
        """Read the slices from the API again and publish what differs (the watchdog's repair)."""
        ...

    def slice_check(self) -> tuple[frozenset[str], frozenset[str]] | None:
        """(device names the pool should hold, device names its slices hold), None while unknown."""
        ...

    def readiness(self) -> Readiness: ...

    def debug_state(self) -> dict[str, object]: ...


@dataclass(frozen=True, slots=True)
class DraTuning:
    """Bounds and clocks; the defaults are the production values, tests shorten them."""

    timeouts: PrepareTimeouts = DEFAULT_PREPARE_TIMEOUTS
    #: serving the plugin sockets, and reading a checkpoint that could not be read at start
    backoff: Backoff = SERVE_BACKOFF
    health_resend_s: float = RESEND_S
    health_sleep: Callable[[float], Awaitable[None]] = field(default=asyncio.sleep)
    #: the monotonic clock the mechanism's observations are stamped with (the handover's)
    clock: Callable[[], float] = time.monotonic


class DraMechanism:
    owner = Owner.DRA

    def __init__(
        self,
        *,
        driver: DraDriver,
        plugin: KubeletPlugin,
        feed: HealthFeed,
        registration: RegistrationState,
        publisher: SlicePublisher,
        ownership: OwnershipState,
        allocated: AllocatedClaims,
        backoff: Backoff = SERVE_BACKOFF,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self.driver = driver
        #: claims allocated on our devices and not prepared yet (looked for while a GPU drains away)
        self.allocated = allocated
        self.plugin = plugin
        self.feed = feed
        self.registration = registration
        self.publisher = publisher
        self._ownership = ownership
        self._backoff = backoff

    async def run(self) -> None:
        """Serve until cancelled; the sockets are removed and calls in flight cancelled on the way out.

        A checkpoint that could not be read at start is tried again (with backoff) before the
        kubelet plugin serves: answering Prepare without knowing what is prepared could hand a
        device out twice.
        """
        attempt = 0
        while not self.driver.prepared.loaded:
            attempt += 1
            await asyncio.sleep(self._backoff.delay(attempt))
            await self._restore()
        try:
            # MIG instances the agent made and no claim needs go before the first claim is served
            await self.driver.start()
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.driver.gate.run(), name="dra-modes")
                tg.create_task(self.plugin.run(), name="dra-plugin")
                tg.create_task(self.feed.run(), name="dra-health-feed")
                tg.create_task(self.publisher.run(), name="dra-slices")
                tg.create_task(self.allocated.run(), name="dra-allocated-claims")
        finally:
            await self.driver.close()

    # --- the Mechanism interface ------------------------------------------------------------

    def readiness(self) -> Readiness:
        """Serving as it should; a node whose config gives DRA no GPU is ready whatever DRA's state
        (a kubelet without DRA, as on 1.32/1.33 with the gate off, rejects the plugin there)."""
        result = self._readiness()
        if result.ok or self._serves_gpus():
            return result
        return Readiness(True, f"no GPU of this node is given to DRA; {result.detail}")

    def _serves_gpus(self) -> bool:
        desired = self._ownership.desired
        return any(desired.owner_of(gpu) is Owner.DRA for gpu in desired.gpus())

    def _readiness(self) -> Readiness:
        own = self._own_readiness()
        published = self.publisher.readiness()
        if not own.ok:
            return own
        if not published.ok:
            return Readiness(False, f"ResourceSlices: {published.detail}")
        notes = [n for n in (own.detail, published.detail and f"ResourceSlices: {published.detail}") if n]
        notes += self._publish_notes()
        return Readiness(True, "; ".join(notes))

    def _publish_notes(self) -> list[str]:
        """GPUs DRA owns that are not published as ``dra.publish`` wishes, and why (ready all the same)."""
        granted = self._ownership.current
        modes = {
            gpu: mode
            for gpu, mode in self.driver.gate.modes().items()
            if granted.granted_to(gpu, Owner.DRA) and (mode.note or mode.effective is not mode.desired)
        }
        if not modes:
            return []
        first = next(iter(modes.values()))
        more = f" (and {len(modes) - 1} more GPUs)" if len(modes) > 1 else ""
        return [f"dra.publish: a GPU is {first.label} where {first.desired.value} is wished: {first.note}{more}"]

    async def _restore(self) -> None:
        try:
            await self.driver.restore()
        except StartupError as exc:
            if str(exc) != self.driver.prepared.load_error:
                log.error("DRA checkpoint cannot be read; DRA waits and retries", error=str(exc))
            self.driver.prepared.load_error = str(exc)

    def _own_readiness(self) -> Readiness:
        prepared = self.driver.prepared
        if not prepared.loaded:
            return Readiness(False, f"DRA checkpoint not loaded: {prepared.load_error or 'not yet'}")
        for endpoint in (self.plugin.dra, self.plugin.registration):
            if endpoint.last_error:
                return Readiness(False, f"DRA plugin cannot serve its {endpoint.name} socket: {endpoint.last_error}")
        if not self.plugin.running:
            return Readiness(False, "DRA plugin not serving yet")
        reg = self.registration
        if reg.status == "rejected":
            return Readiness(False, f"the kubelet rejected the DRA plugin: {reg.reason}")
        if reg.status == "waiting":
            if reg.info_calls:
                return Readiness(True, "registration in progress: GetInfo answered, no NotifyRegistrationStatus yet")
            # no kubelet (yet): nothing is wrong with the agent, and it registers the moment one looks
            return Readiness(True, f"waiting for the kubelet: no GetInfo call on {self.plugin.registration.path} yet")
        return Readiness(True)

    def advertised_gpus(self) -> frozenset[str]:
        return self.publisher.published_gpus()

    def gpu_details(self) -> dict[str, dict[str, object]]:
        """Per GPU: its publish mode, the MIG instances made for claims, the shares, what is free."""
        gate = self.driver.gate
        found = occupancy(
            self.driver.inventory,
            modes=gate.modes(),
            devices=gate.devices_by_name(),
            counter_sets=gate.counter_sets(),
            claims=self.driver.prepared,
        )
        return {gpu: o.as_dict() for gpu, o in found.items()}

    def usage(self) -> Usage:
        prepared = self.driver.prepared
        if not prepared.loaded:
            return Usage(known=False, reason=f"the DRA checkpoint is not loaded: {prepared.load_error or 'not yet'}")
        holders: dict[str, list[Holder]] = {}
        for claim in prepared.values():
            add_claim(
                holders,
                namespace=claim.namespace,
                name=claim.name,
                uid=claim.uid,
                devices=((d.gpu_uuid, d.name) for d in claim.devices),
                detail="" if claim.complete else "rebuilt from its CDI spec; name unknown until prepared again",
                since=claim.prepared_at,
            )
        for ref, planned in self.driver.in_preparation():
            # a claim being prepared holds its devices already: a drain must wait for it too
            devices = ((p.device.gpu_uuid, p.device.name) for p in planned)
            add_claim(
                holders, namespace=ref.namespace, name=ref.name, uid=ref.uid, devices=devices, detail="being prepared"
            )
        now = self._clock()
        if not self.allocated.needed():
            return Usage(known=True, holders={gpu: tuple(h) for gpu, h in holders.items()}, as_of=now)
        # a GPU drains away: claims the scheduler allocated on it and the kubelet has not had
        # prepared yet hold it too; the observation is as old as the pod list it comes from
        view = self.allocated.view()
        if not view.known:
            return Usage(known=False, reason=view.reason)
        for gpu, allocated in view.holders.items():
            holders.setdefault(gpu, []).extend(allocated)
        return Usage(known=True, holders={gpu: tuple(h) for gpu, h in holders.items()}, as_of=min(now, view.as_of))

    def scheduler_view(self) -> SchedulerView:
        """The scheduler reads ResourceSlices directly: a GPU left out of them is closed at once."""
        return SchedulerView()

    def registration_checks(self, node: NodeStatus) -> list[RegistrationCheck]:
        """The devices the pool should hold against those its ResourceSlices hold (the publisher's view)."""
        seen = self.publisher.slice_check()
        if seen is None:
            return []
        expected, published = seen
        extra, missing = sorted(published - expected), sorted(expected - published)
        detail = f"the pool should hold {len(expected)} devices, its ResourceSlices hold {len(published)}"
        if missing:
            detail += f"; missing: {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else "")
        if extra:
            detail += f"; not ours to publish: {', '.join(extra[:3])}" + (" ..." if len(extra) > 3 else "")
        return [
            RegistrationCheck(
                key=f"{self.driver.pool} resourceslices",
                advertised=len(expected),
                seen=len(published),
                agrees=expected == published,
                detail=detail,
                repair=lambda reason: self.publisher.resync(),
            )
        ]

    def debug_state(self) -> dict[str, object]:
        usage = self.usage()
        return {
            "ready": self.readiness().ok,
            "readiness": self.readiness().detail,
            "driver": self.driver.driver_name,
            "pool": self.driver.pool,
            "registration": self.registration.as_dict(),
            "plugin": self.plugin.debug_state(),
            "prepared_claims": len(self.driver.prepared),
            "claims_by_gpu": {
                gpu: [
                    {
                        "namespace": h.namespace,
                        "name": h.name,
                        "uid": h.uid,
                        "devices": list(h.devices),
                        "since": h.since,
                        **({"note": h.detail} if h.detail else {}),
                    }
                    for h in hs
                ]
                for gpu, hs in sorted(usage.holders.items())
            },
            "checkpoint": self.driver.prepared.checkpoint.as_dict(),
            "publish": {gpu: mode.as_dict() for gpu, mode in sorted(self.driver.gate.modes().items())},
            "mig_instances": self.driver.instances.debug_state(),
            "mps": self.driver.shares.debug_state(),
            "health": {
                "streams": self.feed.streams,
                "messages_sent": self.feed.messages_sent,
                "resend_s": self.feed.resend_s,
                "timeout_s": self.feed.timeout_s,
            },
            "slices": self.publisher.debug_state(),
            "claim_reads": self.driver.claim_source_state(),
        }


async def build_dra(
    config: Config,
    *,
    claims: ClaimSource,
    publisher: SlicePublisher,
    node: NodeFacts,
    cdi: CdiProvider,
    registry: CollectorRegistry | None,
    node_name: str,
    boot_id: str | None = None,
    tuning: DraTuning = DraTuning(),
    gate: ModeGate | None = None,
    mig: MigControl | None = None,
    mps: MpsControl | None = None,
    pods: PodClaimLister | None = None,
) -> DraMechanism:
    """Build the DRA mechanism and restore its prepared claims; call before the CDI service runs.

    A state directory that cannot be read at all leaves the mechanism not ready (it retries
    in ``run``); a corrupt checkpoint is moved aside and rebuilt instead. ``gate`` (each GPU's
    publish shape) is shared with the ResourceSlice publisher; ``mig`` and ``mps`` are the
    backend's (none: dynamic MIG and MPS fail per claim, naming why). ``pods`` lists the claims
    of this node's pods (None without API access: nothing can be allocated from slices that are
    never published).
    """
    driver_name = config.dra.driver_name
    metrics = DraMetrics(registry)
    prepared = PreparedClaims(
        CheckpointStore(config.state_dir), boot_id=read_boot_id() if boot_id is None else boot_id, metrics=metrics
    )
    specs = ClaimSpecWriter(
        cdi, cdi_root=config.paths.cdi_root if config.cdi.enabled else None, claim_kind=config.cdi.claim_kind
    )
    driver = DraDriver(
        driver_name=driver_name,
        pool=node_name,
        claims=claims,
        node=node,
        prepared=prepared,
        specs=specs,
        metrics=metrics,
        gate=gate,
        mig=mig,
        mps=mps,
        timeouts=tuning.timeouts,
    )
    feed = HealthFeed(
        pool=node_name,
        node=node,
        resend_s=tuning.health_resend_s,
        sleep=tuning.health_sleep,
        gate=driver.gate,
        health_uuid=driver.health_uuid,
    )
    dra_socket = config.dra_plugin_dir / DRA_SOCKET
    registration = RegistrationState(driver_name=driver_name, endpoint=dra_socket)
    plugin = KubeletPlugin(
        dra_socket=dra_socket,
        registration_socket=config.paths.kubelet_root / REGISTRY_DIR / registration_socket_name(driver_name),
        dra_handlers=[v1_servicer(driver, metrics), v1beta1_servicer(driver, metrics), HealthServicer(feed, metrics)],
        registration_handlers=[RegistrationServicer(registration, metrics, on_registered=publisher.kick)],
        backoff=tuning.backoff,
    )
    allocated = AllocatedClaims(
        pods=pods,
        claims=claims,
        driver=driver_name,
        pool=node_name,
        gpu_of=driver.gpu_of_device,
        prepared=prepared,
        ownership=node.ownership,
        clock=tuning.clock,
    )
    mechanism = DraMechanism(
        driver=driver,
        allocated=allocated,
        clock=tuning.clock,
        plugin=plugin,
        feed=feed,
        registration=registration,
        publisher=publisher,
        ownership=node.ownership,
        backoff=tuning.backoff,
    )
    await mechanism._restore()  # an unreadable state directory is retried by run(), not fatal
    cdi.set_prepared_claims(functools.partial(specs_to_keep, prepared))
    if registry is not None:
        registry.register(PartitionCollector(mechanism.gpu_details, inventory=node.inventory))
    return mechanism
