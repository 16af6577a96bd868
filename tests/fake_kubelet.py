"""A rude fake kubelet: the device manager's side of the Device Plugin API, as a v1.36 kubelet acts.

Test double for the plugin tests, the e2e tests and ``bench/bench_plugin.py``; holds no tests.
Built on grpcio's *threaded* server and client, like the Go kubelet's goroutines, so it keeps
working while the agent's event loop is blocked: a synchronous call such as
:meth:`FakeKubelet.restart_now` made on the loop thread is a kubelet restart that happens while
the agent is paused.

:class:`FakeKubelet` is the kubelet installation (one ``device-plugins`` directory); every start
is a new kubelet *process* (:class:`KubeletProcess`) with its own counts, so a test can say
"exactly one registration per kubelet start". What a start does, as the real kubelet does
(kubernetes/kubernetes ``pkg/kubelet/cm/devicemanager/``, and a real v1.36 kubelet observed):

* it removes every file in ``device-plugins/`` except its checkpoint
  ``kubelet_internal_checkpoint`` (directories stay), then listens on a new ``kubelet.sock``.
  Variants for tests: the two steps in swapped order, and the new ``kubelet.sock`` forced onto
  the inode number of the old one (see :func:`_bind_on_inode`; bound under a side name, then
  renamed into place);
* ``Register`` checks the version and the resource name, dials the endpoint the way
  ``grpc.WithBlock`` does (it waits for the socket up to ``dial_timeout_s``), calls
  GetDevicePluginOptions, keys the plugin by resource name (a newer registration replaces the
  endpoint) and returns; then it opens ListAndWatch on that same connection;
* every ListAndWatch message it takes is written to its checkpoint ``kubelet_internal_checkpoint``
  (each resource's healthy device IDs, ``RegisteredDevices``), which survives its restarts; a
  stream's end is not written;
* when any ListAndWatch stream of a resource ends, it processes the end a moment later
  (``stream_end_delay_s``) by disconnecting the resource's *current* client — the new one, if
  the plugin registered again meanwhile: the dropped-new-connection race of §13 — and marking
  the resource unhealthy (allocatable 0);
* when it stops, every connection it holds closes, so the plugin sees its streams end. A clean
  stop removes ``kubelet.sock`` (Go's listener does, and so does grpcio's); a crash leaves the
  file behind, same inode, refusing connections until the next start wipes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import grpc

from tests._grpcio import deviceplugin_v1beta1_pb2 as pb
from tests._grpcio import deviceplugin_v1beta1_pb2_grpc as pb_grpc

CHECKPOINT = "kubelet_internal_checkpoint"
KUBELET_SOCKET = "kubelet.sock"
#: extended resource names: a domain, a slash, a name part of at most 63 characters
_RESOURCE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")

RestartOrder = Literal["wipe-first", "socket-first"]


@dataclass
class RegisterCall:
    request: pb.RegisterRequest
    #: what GetDevicePluginOptions answered inside Register (None: the dial failed)
    options: pb.DevicePluginOptions | None = None
    error: str = ""
    accepted: bool = False
    #: which kubelet start received it (1-based)
    start: int = 0
    at: float = field(default_factory=time.monotonic)


class PluginClient:
    """The kubelet's client of one registered endpoint: its connection and ListAndWatch stream."""

    def __init__(self, process: KubeletProcess, resource: str, channel: grpc.Channel) -> None:
        self.process = process
        self.resource = resource
        self.channel = channel
        self.stub = pb_grpc.DevicePluginStub(channel)
        self.messages = 0
        self.devices: list[pb.Device] = []
        #: the number of devices in each message, in order (an empty first one is a wrong answer:
        #: the kubelet takes it as "no GPUs here" and fails every pod it admits meanwhile)
        self.counts: list[int] = []
        self.opened_at: float | None = None
        self.ended = False
        self.end_reason = ""
        self.thread = threading.Thread(target=self._run, name=f"kubelet-{process.index}-{resource}", daemon=True)

    @property
    def live(self) -> bool:
        """The stream is open and has delivered the device list."""
        return self.messages > 0 and not self.ended

    def _run(self) -> None:
        try:
            call = self.stub.ListAndWatch(pb.Empty())
            for response in call:
                with self.process.lock:
                    if self.opened_at is None:
                        self.opened_at = time.monotonic()
                    self.messages += 1
                    self.devices = list(response.devices)
                    self.counts.append(len(response.devices))
                    if self.process.clients.get(self.resource) is self:
                        self.process.write_checkpoint()
            self.end_reason = "OK"
        except grpc.RpcError as exc:
            self.end_reason = f"{exc.code()}"  # type: ignore[attr-defined]
        except ValueError:  # the channel was closed under the call
            self.end_reason = "channel closed"
        finally:
            self.ended = True
            self.process._stream_ended(self)

    def disconnect(self) -> None:
        self.channel.close()


class KubeletProcess:
    """One kubelet start: its registration server, clients and counts."""

    def __init__(self, kubelet: FakeKubelet, index: int) -> None:
        self.kubelet = kubelet
        self.index = index
        self.lock = threading.RLock()
        self.alive = True
        self.calls: list[RegisterCall] = []
        #: resource name -> current client (the endpoint the kubelet uses)
        self.clients: dict[str, PluginClient] = {}
        self.all_clients: list[PluginClient] = []
        #: resource name -> why it was marked unhealthy (its stream ended)
        self.disconnected: dict[str, str] = {}
        #: current clients dropped because an older stream of the same resource ended
        self.dropped_new = 0
        self.kubelet_sock_inode = 0
        self._channels: list[grpc.Channel] = []
        self._server: grpc.Server | None = None

    # --- what tests read ---------------------------------------------------------------

    def registrations(self, resource: str) -> int:
        """Register calls for ``resource`` this start accepted."""
        with self.lock:
            return sum(1 for c in self.calls if c.accepted and c.request.resource_name == resource)

    def holds_live_stream(self, resource: str) -> bool:
        """The resource's current client has an open stream and the resource counts as healthy."""
        with self.lock:
            client = self.clients.get(resource)
            return client is not None and client.live and resource not in self.disconnected

    def allocatable(self, resource: str) -> int:
        """Healthy devices the node would advertise: 0 once the resource's stream ended."""
        with self.lock:
            client = self.clients.get(resource)
            if client is None or resource in self.disconnected:
                return 0
            return sum(1 for d in client.devices if d.health == "Healthy")

    # --- Registration service (grpcio handler threads) ------------------------------------

    def register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        call = RegisterCall(request=request, start=self.index)
        with self.lock:
            self.calls.append(call)
        if request.version != "v1beta1":
            call.error = f'requested API version "{request.version}" is not supported by kubelet'
            context.abort(grpc.StatusCode.UNKNOWN, call.error)
        if not _RESOURCE_NAME.match(request.resource_name) or request.resource_name.startswith("kubernetes.io/"):
            call.error = f'the ResourceName "{request.resource_name}" is invalid'
            context.abort(grpc.StatusCode.UNKNOWN, call.error)
        if self.kubelet.before_dial is not None:
            self.kubelet.before_dial()
        channel = grpc.insecure_channel(f"unix:{self.kubelet.plugin_dir / request.endpoint}")
        with self.lock:
            if not self.alive:
                channel.close()
                context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet stopping")
            self._channels.append(channel)
        try:
            # grpc.WithBlock: wait for the endpoint to accept, up to the dial timeout
            stub = pb_grpc.DevicePluginStub(channel)
            call.options = stub.GetDevicePluginOptions(
                pb.Empty(), timeout=self.kubelet.dial_timeout_s, wait_for_ready=True
            )
        except grpc.RpcError as exc:
            call.error = f"cannot dial plugin endpoint: {exc.code()}"  # type: ignore[attr-defined]
            channel.close()
            context.abort(grpc.StatusCode.UNKNOWN, call.error)
        except ValueError:  # the kubelet stopped and closed the channel under the dial
            call.error = "cannot dial plugin endpoint: kubelet stopping"
            channel.close()
            context.abort(grpc.StatusCode.UNKNOWN, call.error)
        if self.kubelet.reject:
            call.error = self.kubelet.reject
            channel.close()
            context.abort(grpc.StatusCode.UNKNOWN, call.error)
        client = PluginClient(self, request.resource_name, channel)
        with self.lock:
            if not self.alive:
                channel.close()
                context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet stopping")
            # keyed by resource name: the newest registration is the endpoint from now on
            self.clients[request.resource_name] = client
            self.all_clients.append(client)
            self.disconnected.pop(request.resource_name, None)
            call.accepted = True
        if self.kubelet.open_streams:
            client.thread.start()  # ListAndWatch, after Register returns (as the kubelet's goroutine)
        return pb.Empty()

    def drop(self, resource: str) -> None:
        """The kubelet ends a resource's stream itself (as it does on a stream error)."""
        with self.lock:
            client = self.clients.get(resource)
        if client is not None:
            client.disconnect()

    def write_checkpoint(self) -> None:
        """What the device manager writes on every ListAndWatch message (not when a stream ends):
        each resource's healthy device IDs, ``RegisteredDevices``. Called with the lock held."""
        registered = {
            resource: [d.ID for d in client.devices if d.health == "Healthy"]
            for resource, client in self.clients.items()
            if resource not in self.disconnected
        }
        body = {"Data": {"PodDeviceEntries": None, "RegisteredDevices": registered}, "Checksum": 0}
        (self.kubelet.plugin_dir / CHECKPOINT).write_text(json.dumps(body))

    def _stream_ended(self, client: PluginClient) -> None:
        """What the kubelet's runClient does when a client's ListAndWatch returns."""
        delay = self.kubelet.stream_end_delay_s
        if delay > 0 and self.alive:
            time.sleep(delay)  # the kubelet processes the end a moment later (a few ms on a real node)
        with self.lock:
            if not self.alive:
                return
            current = self.clients.get(client.resource)
            if current is None:
                return
            # the current client, whichever stream ended: a newer registration is dropped here
            del self.clients[client.resource]
            self.disconnected[client.resource] = f"stream of client {self.all_clients.index(client)} ended"
            if current is not client:
                self.dropped_new += 1
        current.disconnect()

    # --- lifecycle (the calling thread) ------------------------------------------------

    def serve(self, path: Path) -> None:
        """Listen on ``path`` (kubelet.sock, or a name it is renamed from)."""
        server = grpc.server(ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"kubelet-{self.index}"))
        handler = grpc.method_handlers_generic_handler(
            "v1beta1.Registration",
            {
                "Register": grpc.unary_unary_rpc_method_handler(
                    self.register,
                    request_deserializer=pb.RegisterRequest.FromString,
                    response_serializer=pb.Empty.SerializeToString,
                )
            },
        )
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"unix:{path}")
        server.start()
        self._server = server
        self.kubelet_sock_inode = os.lstat(path).st_ino

    def unserve(self) -> None:
        """Stop listening (grpcio removes the file under the name it bound)."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace=None).wait(5)

    def stop(self) -> None:
        """The process dies: the registration server and every connection it holds go."""
        with self.lock:
            self.alive = False
            channels, self._channels = self._channels, []
            clients = list(self.all_clients)
        self.unserve()
        # a socket renamed into place keeps its file: remove it as a clean stop would
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(self.kubelet.socket).st_ino == self.kubelet_sock_inode:
                os.unlink(self.kubelet.socket)
        for channel in channels:
            channel.close()
        for client in clients:
            if client.thread.is_alive():
                client.thread.join(5)


class FakeKubelet:
    """The kubelet's device-plugin side on ``<plugin_dir>/kubelet.sock`` (grpcio, threads)."""

    def __init__(self, plugin_dir: Path, *, dial_timeout_s: float = 10.0, stream_end_delay_s: float = 0.02) -> None:
        self.plugin_dir = plugin_dir
        self.socket = plugin_dir / KUBELET_SOCKET
        self.dial_timeout_s = dial_timeout_s
        self.stream_end_delay_s = stream_end_delay_s
        self.reject = ""  # when set, Register fails with this message (after dialling the plugin)
        #: False: accept Register but never open ListAndWatch (a kubelet in trouble)
        self.open_streams = True
        #: called in the Register handler before it dials the plugin (a test's hook into that moment)
        self.before_dial: Callable[[], None] | None = None
        self.starts: list[KubeletProcess] = []
        #: restarts whose new kubelet.sock got the old inode number
        self.inode_reuses = 0
        self._lock = threading.Lock()

    @property
    def current(self) -> KubeletProcess | None:
        """The running kubelet process, if any."""
        process = self.starts[-1] if self.starts else None
        return process if process is not None and process.alive else None

    @property
    def calls(self) -> list[RegisterCall]:
        """Every Register call, over all starts."""
        return [c for p in self.starts for c in p.calls]

    def calls_for(self, resource: str) -> list[RegisterCall]:
        return [c for c in self.calls if c.request.resource_name == resource]

    def holds_live_stream(self, resource: str) -> bool:
        process = self.current
        return process is not None and process.holds_live_stream(resource)

    # --- synchronous: on the event loop thread these run while the agent is paused ---------

    def start_now(self, *, order: RestartOrder = "wipe-first", reuse_inode: int | None = None) -> KubeletProcess:
        """Start a kubelet process: wipe device-plugins/, listen on a new kubelet.sock."""
        with self._lock:
            if self.current is not None:
                raise RuntimeError("a kubelet is already running")
            self.plugin_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
            if not (self.plugin_dir / CHECKPOINT).exists():
                (self.plugin_dir / CHECKPOINT).write_text('{"Data": {}, "Checksum": 0}')
            process = KubeletProcess(self, len(self.starts) + 1)
            if order == "wipe-first":
                self._wipe()
                self._listen(process, reuse_inode)
            else:
                self._listen(process, reuse_inode)
                self._wipe(keep=KUBELET_SOCKET)
            self.starts.append(process)
            if reuse_inode is not None and process.kubelet_sock_inode == reuse_inode:
                self.inode_reuses += 1
            return process

    def stop_now(self, *, crash: bool = False) -> None:
        """The kubelet process ends; after a ``crash`` its kubelet.sock file stays behind."""
        process = self.current
        if process is None:
            return
        if not crash:
            process.stop()
            return
        # grpcio removes the file when it stops listening: keep the inode under a second name
        keep = self.plugin_dir / f".{KUBELET_SOCKET}.crashed"
        os.link(self.socket, keep)
        process.stop()
        os.rename(keep, self.socket)

    def restart_now(
        self, *, order: RestartOrder = "wipe-first", reuse_inode: bool = False, crash: bool = False
    ) -> KubeletProcess:
        """Stop the running kubelet and start a new one; ``reuse_inode`` puts the new kubelet.sock
        on the old one's inode number when the file system allows (see :attr:`inode_reuses`)."""
        old = self.current
        self.stop_now(crash=crash)
        inode = old.kubelet_sock_inode if old is not None and reuse_inode else None
        return self.start_now(order=order, reuse_inode=inode)

    # --- asynchronous: the agent keeps running meanwhile (the kubelet is another process) ---

    async def start(self) -> KubeletProcess:
        return await asyncio.to_thread(self.start_now)

    async def stop(self, *, crash: bool = False) -> None:
        await asyncio.to_thread(self.stop_now, crash=crash)

    async def restart(
        self,
        *,
        order: RestartOrder = "wipe-first",
        reuse_inode: bool = False,
        crash: bool = False,
        between: Callable[[], Awaitable[Any]] | None = None,
    ) -> KubeletProcess:
        """A restart in a worker thread; ``between`` is awaited after the old kubelet died and
        before the new one starts (a kubelet that takes its time to come back)."""
        old = self.current
        await asyncio.to_thread(self.stop_now, crash=crash)
        if between is not None:
            await between()
        inode = old.kubelet_sock_inode if old is not None and reuse_inode else None
        return await asyncio.to_thread(self.start_now, order=order, reuse_inode=inode)

    # --- the directory ---------------------------------------------------------------------

    def _wipe(self, keep: str = "") -> None:
        """Remove every non-directory file but the checkpoint (CleanupPluginDirectory)."""
        for entry in os.scandir(self.plugin_dir):
            if entry.name in (CHECKPOINT, keep) or entry.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)

    def _listen(self, process: KubeletProcess, reuse_inode: int | None) -> None:
        if reuse_inode is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket)
            process.serve(self.socket)
            return
        # bound under a side name until it has the wanted number (another process may take the
        # number first: try again), then renamed into place, as one directory event
        side = self.plugin_dir / f".{KUBELET_SOCKET}.new"
        for attempt in range(8):
            with _bind_on_inode(self.plugin_dir, side, reuse_inode):
                process.serve(side)
            if process.kubelet_sock_inode == reuse_inode or attempt == 7:
                break
            process.unserve()
        os.rename(side, self.socket)


@contextlib.contextmanager
def _bind_on_inode(directory: Path, path: Path, inode: int, limit: int = 512) -> Iterator[None]:
    """Make the next file created in ``directory`` likely to get inode number ``inode``.

    ext4 gives a new file the lowest free inode of its directory's block group, and the old
    kubelet.sock's number is free again once the file is removed. Placeholder files take every
    lower free number until one lands on ``inode``; that one is removed again, so the socket
    bound inside the block takes it; the placeholders go on the way out. File systems that never
    hand a number out twice (tmpfs) just leave ``inode`` unreached: the caller compares.
    """
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    holders: list[Path] = []
    try:
        for n in range(limit):
            holder = directory / f".inode-holder-{n}"
            fd = os.open(holder, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            holders.append(holder)
            got = os.fstat(fd).st_ino
            os.close(fd)
            if got == inode:
                os.unlink(holder)
                holders.pop()
                break
        yield
    finally:
        for holder in holders:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(holder)
