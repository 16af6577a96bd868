"""One resource's device-plugin server: serve on its socket, Register, stay registered.

:meth:`PluginServer.run` (until cancelled) is a reconcile loop. Each pass observes the state —
is this run serving, is its socket file still there, does the kubelet hold a ListAndWatch stream
of this run (:class:`~agent.deviceplugin.link.KubeletLink`), did the latest Register get its stream —
and takes the one step :func:`~agent.deviceplugin.registration.decide` names: at most one
stop -> serve -> Register. Then it sleeps until a wake-up (:meth:`PluginServer.wake`: the
manager's directory events, a stream of this run opening or ending) or a timer of its own
(a retry's backoff, the bound on the kubelet opening its stream).

Events are hints, never counted: a wake-up is followed by a short settle (``settle_s`` without
another wake-up, ``settle_max_s`` at most), so a kubelet restart's two filesystem events a few
milliseconds apart, or everything that queued while the agent was paused, make one pass that
sees where things ended up.

A run (:class:`~agent.deviceplugin.run.ServerRun`) serves a fresh service on
``<device-plugins>/<socket>``; then ``Registration/Register`` goes to ``kubelet.sock``. The
kubelet calls GetDevicePluginOptions on us from inside its Register handler, which works
because the server runs on this loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from grpclib.client import Channel

from agent._proto.deviceplugin import v1beta1 as pb
from agent.base.backoff import Backoff
from agent.base.logs import Persistent
from agent.core.config.schema import PluginConfig
from agent.core.inventory.model import Inventory
from agent.deviceplugin.link import KubeletLink
from agent.deviceplugin.metrics import PluginMetrics
from agent.deviceplugin.preferred import TopologyScorer
from agent.deviceplugin.registration import Action, Observation, Step, decide
from agent.deviceplugin.resources import DeviceState, Resource
from agent.deviceplugin.run import ServerRun
from agent.deviceplugin.service import ResourceService

log = structlog.get_logger("agent.plugin")

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"


@dataclass(frozen=True, slots=True)
class RegistrationTimeouts:
    """Bounds on one plugin server's cycle: serve, check the socket, Register, the kubelet's stream."""

    self_check_s: float = 5.0
    register_s: float = 10.0  # the kubelet itself dials us with a 10 s limit inside Register
    # how long a stopping run waits for its streams to end before cancelling them (a client
    # that stopped reading); kept short so a restart is quick
    stream_drain_s: float = 0.25
    #: how long the kubelet may take after accepting Register to open ListAndWatch (it starts
    #: the stream at once; seconds mean a kubelet in trouble) before we register again
    stream_open_s: float = 5.0
    #: after a watchdog repair stops a run: how long before it serves and registers again, so the
    #: kubelet has handled the end of the old stream (it takes milliseconds)
    repair_pause_s: float = 0.5
    #: quiet time that ends a burst of wake-ups: a kubelet restart's socket wipe and new
    #: kubelet.sock, ms apart, or everything that queued while the agent was paused
    settle_s: float = 0.05
    #: longest a steady stream of wake-ups may hold a pass back
    settle_max_s: float = 1.0


#: between attempts of a server that failed to serve its socket or to register
REGISTRATION_BACKOFF = Backoff(initial_s=0.2)
DEFAULT_REGISTRATION_TIMEOUTS = RegistrationTimeouts()

MakeService = Callable[[Resource, KubeletLink], ResourceService]


#: listeners one run may add while a Register is in flight (see PluginServer._await_register)
MAX_RELISTENS = 3


class PluginServer:
    def __init__(
        self,
        *,
        resource: Resource,
        make_service: MakeService,
        plugin_dir: Path,
        metrics: PluginMetrics,
        backoff: Backoff = REGISTRATION_BACKOFF,
        timeouts: RegistrationTimeouts = DEFAULT_REGISTRATION_TIMEOUTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.resource = resource
        self.socket_path = plugin_dir / resource.socket_name
        self.kubelet_socket = plugin_dir / KUBELET_SOCKET
        self._make_service = make_service
        self._metrics = metrics
        self._backoff = backoff
        self._timeouts = timeouts
        self._clock = clock
        self._run: ServerRun | None = None
        self._rpc_histograms: dict[tuple[str, str], Any] = {}
        self._wake = asyncio.Event()
        self._retry_at: float | None = None
        self._stream_deadline: float | None = None
        self._start_failures = 0
        self._register_failures = 0
        # a kubelet that is not there, or a socket we may not make, lasts: said once, then at debug
        self._register_noise = Persistent()
        self._start_noise = Persistent()
        self._unanswered = 0  # accepted Registers in a row whose stream never came
        self._waiting = False
        #: the watchdog's reason for a repair, until the next pass restarts the run
        self._repair = ""
        self._paused_until: float | None = None
        self.repairs = 0
        self.last_error = ""
        self.last_restart_reason = ""
        self.attempts = 0  # Register calls since the last accepted one
        self.registrations = 0  # accepted Register calls since start
        self.runs = 0
        self.passes = 0

    # --- what the manager calls ---------------------------------------------------------

    @property
    def service(self) -> ResourceService | None:
        return self._run.service if self._run is not None else None

    @property
    def serving(self) -> bool:
        return self._run is not None and self._run.serving

    @property
    def registered(self) -> bool:
        """The kubelet holds a ListAndWatch stream of the current run."""
        return self._run is not None and self._run.link.kubelet_stream_open

    @property
    def open_streams(self) -> int:
        return self._run.link.open_streams if self._run is not None else 0

    @property
    def repairing(self) -> bool:
        """Stopped by a watchdog repair, pausing before it serves and registers again."""
        return self._paused_until is not None

    @property
    def quiet(self) -> bool:
        """Waiting for a wake-up with none pending (tests wait for this before looking)."""
        return self._waiting and not self._wake.is_set()

    def wake(self) -> None:
        """Something may have changed (a hint): look again, once things settle.

        A pending retry is due at once: what woke us (a new kubelet.sock) may be what it waited
        for. The bound on the kubelet's stream is kept: registering again early is the double
        registration this design avoids.
        """
        self._retry_at = None
        self._wake.set()

    def request_repair(self, reason: str) -> None:
        """The watchdog saw the kubelet disagree with us: restart and register at the next pass."""
        self._repair = reason or "the kubelet disagrees with the devices we list"
        self.wake()

    def update(self, resource: Resource, *, config: PluginConfig, inventory: Inventory, scorer: TopologyScorer) -> None:
        """Adopt a re-planned resource of the same name in place (inventory or plugin config changed).

        Called by the manager on the loop thread. No restart and no new Register: the current
        run's service switches to ``resource``, ``config`` and ``inventory`` and its open
        ListAndWatch streams send the new list; a later run gets them from ``make_service``.
        """
        if resource.name != self.resource.name:
            raise ValueError(f"server for {self.resource.name} cannot serve {resource.name}")
        self.resource = resource
        if self._run is not None:
            self._run.service.update(resource=resource, config=config, inventory=inventory, scorer=scorer)
            self._update_device_gauge()

    def notify(self) -> None:
        """The device list may have changed: open ListAndWatch streams send it again."""
        if self._run is not None:
            self._run.service.notify()
            self._update_device_gauge()

    def advertised(self) -> list[DeviceState]:
        """The devices this server offers the kubelet now (none while it is not serving)."""
        return self._run.service.devices() if self._run is not None and self.serving else []

    def kubelet_view(self) -> frozenset[str]:
        """The device IDs the kubelet should count as allocatable now: the healthy ones we list,
        while it holds our stream; none otherwise (the kubelet marks a plugin's devices unhealthy
        the moment its stream ends)."""
        if not self.registered:
            return frozenset()
        return frozenset(d.device.id for d in self.advertised() if d.healthy)

    def debug_state(self) -> dict[str, object]:
        run = self._run
        devices = run.service.devices() if run is not None else []
        link = run.link.debug_state() if run is not None else KubeletLink().debug_state()
        return {
            "socket": str(self.socket_path),
            "serving": self.serving,
            "socket_present": run is not None and run.socket_present(),
            **link,
            "registrations": self.registrations,
            "register_attempts": self.attempts,
            "last_register_error": self.last_error,
            "last_restart_reason": self.last_restart_reason,
            "runs": self.runs,
            "device_count": len(devices),
            "healthy_count": sum(1 for d in devices if d.healthy),
            "open_streams": self.open_streams,
            "reconcile_passes": self.passes,
            "watchdog_repairs": self.repairs,
        }

    # --- the loop -----------------------------------------------------------------------

    async def run(self) -> None:
        with structlog.contextvars.bound_contextvars(resource=self.resource.name):
            try:
                while True:
                    self.passes += 1
                    step = decide(self._observe())
                    until = await self._take(step)
                    await self._sleep(until)
            finally:
                await self._stop()
                # gone for good (resource vanished, plugin off, shutdown): advertises nothing
                for health in ("Healthy", "Unhealthy"):
                    self._metrics.devices.labels(self.resource.name, health).set(0)

    def _observe(self) -> Observation:
        run = self._run
        return Observation(
            now=self._clock(),
            serving=self.serving,
            socket_present=run is not None and run.socket_present(),
            kubelet_stream_open=run is not None and run.link.kubelet_stream_open,
            accepted=run is not None and run.link.accepted,
            stream_seen=run is not None and run.link.stream_seen,
            stream_deadline=self._stream_deadline,
            retry_at=self._retry_at,
            repair=self._repair,
            paused_until=self._paused_until,
        )

    async def _take(self, step: Step) -> float | None:
        """Do ``step``; returns when to look again without a wake-up (None: only on one)."""
        if step.action is Action.IDLE:
            self._unanswered = 0
            return None
        if step.action is Action.WAIT:
            return step.until
        if step.action is Action.STOP:
            self._repair = ""
            self.repairs += 1
            self.last_restart_reason = step.reason
            log.warning("stopping the device plugin server to register again", reason=step.reason)
            await self._stop()
            self._paused_until = self._clock() + self._timeouts.repair_pause_s
            return self._paused_until
        if step.action is Action.START:
            self._repair = ""  # a fresh run is what a repair asks for
            self._paused_until = None
        if step.action is Action.RESTART:
            self.last_restart_reason = step.reason
            log.info("restarting device plugin server", reason=step.reason)
            await self._stop()
        if step.action in (Action.START, Action.RESTART):
            if not await self._start():
                return self._retry_at
        else:
            self.last_restart_reason = step.reason
            level = logging.INFO if self._register_failures == 0 else logging.DEBUG  # a failure said it retries
            log.log(level, "registering with the kubelet again", reason=step.reason)
        await self._register()
        return self._retry_at if self._retry_at is not None else self._stream_deadline

    async def _sleep(self, until: float | None) -> None:
        """Until a wake-up has settled, or ``until`` (monotonic) passes with none."""
        timeout = None if until is None else max(0.0, until - self._clock())
        self._waiting = True
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
        finally:
            self._waiting = False
        if not self._wake.is_set():
            return
        settle_until = self._clock() + self._timeouts.settle_max_s
        while True:
            self._wake.clear()
            quiet = min(self._timeouts.settle_s, settle_until - self._clock())
            if quiet <= 0:
                return
            try:
                async with asyncio.timeout(quiet):
                    await self._wake.wait()
            except TimeoutError:
                return

    async def _start(self) -> bool:
        """Serve a new run and self-check it; on failure schedule a retry and return False."""
        self.runs += 1
        service = self._make_service(self.resource, KubeletLink(on_change=self._on_link_change))
        self._run = ServerRun(self.socket_path, service, observe=self._observe_rpc)
        try:
            await self._run.start(self_check_s=self._timeouts.self_check_s)
        except Exception as exc:  # StartupError, a self-check that fails or times out
            self._start_failures += 1
            self._metrics.serve_errors.labels(self.resource.name).inc()
            self.last_error = f"serve on {self.socket_path}: {exc}"
            delay = self._backoff.delay(self._start_failures)
            log.log(
                self._start_noise.level(self.last_error),
                "device plugin server failed to start",
                error=self.last_error,
                attempt=self._start_failures,
                retry_in_s=round(delay, 3),
            )
            await self._stop()
            self._retry_at = self._clock() + delay
            return False
        self._start_failures = 0
        self._start_noise.clear()
        self.attempts = 0
        log.info("serving device plugin", socket=str(self.socket_path), devices=len(service.devices()))
        self._update_device_gauge()
        return True

    async def _register(self) -> None:
        """One Register call; success starts the wait for the kubelet's stream, failure a backoff."""
        run = self._run
        assert run is not None
        if not run.socket_present():
            # never send the kubelet to a path that is not ours: it would dial (and wait for) a
            # file our next run creates, and register that run behind our back
            self._wake.set()
            return
        options = run.service.options
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=self.socket_path.name,
            resource_name=self.resource.name,
            options=pb.DevicePluginOptions(
                pre_start_required=options.pre_start_required,
                get_preferred_allocation_available=options.get_preferred_allocation_available,
            ),
        )
        self.attempts += 1
        run.link.register_started()
        channel = Channel(path=str(self.kubelet_socket))
        try:
            call = asyncio.ensure_future(
                pb.RegistrationStub(channel).register(request, timeout=self._timeouts.register_s)
            )
            await self._await_register(call, run)
        except Exception as exc:  # grpc status, no socket, refused, timeout: all retried
            run.link.register_finished(accepted=False)
            self._register_failures += 1
            self.last_error = f"Register with {self.kubelet_socket}: {type(exc).__name__}: {exc}"
            self._metrics.registrations.labels(self.resource.name, "error").inc()
            delay = self._backoff.delay(self._register_failures)
            self._retry_at = self._clock() + delay
            self._stream_deadline = None
            log.log(
                self._register_noise.level(self.last_error),
                "registration with the kubelet failed",
                error=self.last_error,
                attempt=self.attempts,
                retry_in_s=round(delay, 3),
            )
        else:
            run.link.register_finished(accepted=True)
            self._register_failures = 0
            self._register_noise.clear()
            self.registrations += 1
            self.last_error = ""
            self._metrics.registrations.labels(self.resource.name, "ok").inc()
            log.info("registered with the kubelet", endpoint=request.endpoint, attempts=self.attempts)
            self.attempts = 0
            # a kubelet that accepts but never opens the stream is asked again, ever more slowly
            self._unanswered += 1
            extra = self._backoff.delay(self._unanswered - 1) if self._unanswered > 1 else 0.0
            self._stream_deadline = self._clock() + self._timeouts.stream_open_s + extra
            self._retry_at = None
        finally:
            channel.close()

    async def _await_register(self, call: asyncio.Future[pb.Empty], run: ServerRun) -> None:
        """Wait for our Register call, keeping a listener at our path meanwhile.

        Inside Register the kubelet dials our socket and waits for it to accept (grpc.WithBlock,
        up to 10 s). If our socket file is removed meanwhile (a kubelet that makes kubelet.sock
        before it wipes the directory), that dial waits for the path to come back: this run
        listens there again, so the dial reaches the run the registration belongs to. A later
        run would otherwise be registered by that late dial and then register itself: twice.
        """
        woken = False
        relistens = 0
        try:
            while not call.done():
                wake = asyncio.ensure_future(self._wake.wait())
                try:
                    await asyncio.wait({call, wake}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    wake.cancel()
                if not self._wake.is_set():
                    continue
                self._wake.clear()
                woken = True
                if not run.socket_present() and relistens < MAX_RELISTENS:
                    relistens += 1
                    await self._relisten(run)
            call.result()
        finally:
            call.cancel()
            if woken:  # what woke us is looked at by the next pass
                self._wake.set()

    async def _relisten(self, run: ServerRun) -> None:
        try:
            await run.relisten()
        except Exception as exc:  # the next pass restarts the run if the file stays missing
            log.warning("cannot listen again during Register", socket=str(self.socket_path), error=str(exc))
            return
        log.info("socket removed while registering: listening again", socket=str(self.socket_path))

    def _on_link_change(self) -> None:
        """A kubelet stream of the current run opened or ended."""
        self._metrics.registered.labels(self.resource.name).set(1 if self.registered else 0)
        if self.registered:
            self._unanswered = 0
            self.last_error = ""
        self.wake()

    async def _stop(self) -> None:
        """End the current run (streams first, then its listeners). Idempotent."""
        run, self._run = self._run, None
        self._stream_deadline = None
        self._metrics.registered.labels(self.resource.name).set(0)
        if run is not None:
            await run.stop(drain_s=self._timeouts.stream_drain_s)

    def _observe_rpc(self, method: str, result: str, seconds: float) -> None:
        # on every RPC: the labelled child is looked up once per (method, result)
        histogram = self._rpc_histograms.get((method, result))
        if histogram is None:
            histogram = self._metrics.rpc_seconds.labels(self.resource.name, method, result)
            self._rpc_histograms[(method, result)] = histogram
        histogram.observe(seconds)

    def _update_device_gauge(self) -> None:
        if self._run is None:
            return
        devices = self._run.service.devices()
        healthy = sum(1 for d in devices if d.healthy)
        self._metrics.devices.labels(self.resource.name, "Healthy").set(healthy)
        self._metrics.devices.labels(self.resource.name, "Unhealthy").set(len(devices) - healthy)
