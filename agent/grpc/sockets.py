"""gRPC servers on Unix sockets: the one place socket files are created and removed.

Used by the device plugin (one socket per resource in the kubelet's ``device-plugins/``) and
by the DRA kubelet plugin. Contract:

* ``start`` creates the parent directory if needed, removes a stale file at the path (a
  leftover of a crashed run; a directory there is an error), then listens there.
* ``close`` stops listening, cancels running handlers, closes open connections (so no client
  keeps talking to a stopped server over a reused connection) and removes the socket file, but only
  if the file is still the one this server created (same inode): after a restart another
  server may already listen at the same path, and its file must survive.
* ``close`` is idempotent and safe before ``start`` or after a failed ``start``.

Every server is bounded by its :class:`~agent.grpc.limits.GrpcLimits`: each call through
:class:`~agent.grpc.limits.CallGate` (message size and shape, concurrent calls and streams,
request time), each connection here: at most ``max_connections`` at once (a new one displaces
the connection without an open call that has been quiet the longest, see
:mod:`agent.grpc.connections`), and a connection without an open call for ``idle_timeout_s`` is
closed after a GOAWAY (1,500 silent connections used to stay open, one file descriptor each).
A connection with an open call (the kubelet's ListAndWatch) is never cut.

grpclib's server and its connections are reached through :mod:`agent.grpc.grpclib_adapter`
(which opens each connection with the stream cap and windows in its first SETTINGS frame).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import structlog
from grpclib.const import Handler

from agent.base.errors import StartupError
from agent.grpc.connections import CappedProtocol, ConnectionCap
from agent.grpc.grpclib_adapter import Http2Settings, ServerProtocol, make_server
from agent.grpc.limits import CallGate, GrpcLimits

log = structlog.get_logger("agent.sockets")

#: sun_path is 108 bytes on Linux, including the terminating NUL
MAX_SOCKET_PATH = 107


async def remove_stale_socket(path: Path, *, probe_s: float = 0.5) -> bool:
    """Remove a socket file nobody serves on (a crashed run's); returns whether one was removed.

    Anything else at ``path`` is left alone and is a StartupError: a directory or a regular
    file, and a socket that still accepts connections (another process serves there). The probe
    connects without blocking the loop; a listener that does not accept within ``probe_s`` (its
    backlog is full) is alive too: only a refused connection proves the file stale.
    """
    # metadata calls on a local directory: microseconds, fine on the loop; the connect is not
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a file that is not a socket"
        raise StartupError(f"cannot listen on {path}: {kind} is in the way")
    if await _accepts(path, within_s=probe_s):
        raise StartupError(f"cannot listen on {path}: another process is serving on it")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return True


async def _accepts(path: Path, *, within_s: float) -> bool:
    try:
        async with asyncio.timeout(within_s):
            _reader, writer = await asyncio.open_unix_connection(str(path))
    except TimeoutError:
        return True  # a listener whose backlog is full: somebody is there
    except OSError:
        return False  # refused (nobody listens), or the file went away meanwhile
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


def _inode(path: Path) -> int | None:
    try:
        return path.lstat().st_ino
    except OSError:
        return None


class _Connection(CappedProtocol):
    """One accepted connection: grpclib's protocol inside, closed once idle for the idle timeout."""

    def __init__(self, inner: ServerProtocol, cap: ConnectionCap, limits: GrpcLimits) -> None:
        super().__init__(inner, cap, start_on_data=True)
        self._grpc = inner
        self._idle_timeout_s = limits.idle_timeout_s
        self._timer: asyncio.TimerHandle | None = None
        self._busy_at = 0.0

    def busy(self) -> bool:
        return self.started and self._grpc.open_streams() > 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.admitted:
            self._busy_at = asyncio.get_running_loop().time()
            self._arm(self._idle_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        super().connection_lost(exc)

    def _arm(self, delay: float) -> None:
        self._timer = asyncio.get_running_loop().call_later(delay, self._check_idle)

    def _check_idle(self) -> None:
        """Close the connection once it has had no open call for the idle timeout."""
        loop = asyncio.get_running_loop()
        timeout = self._idle_timeout_s
        if not self.started:  # not a byte received: silent since it connected
            if loop.time() - self._busy_at >= timeout:
                self.close()
            else:
                self._arm(timeout - (loop.time() - self._busy_at))
            return
        protocol = self._grpc
        if protocol.open_streams():
            self._busy_at = loop.time()
        elif (last_stream := protocol.last_stream_started()) is not None:
            # a call that opened and ended between two checks (monotonic clock, like the loop's)
            self._busy_at = max(self._busy_at, loop.time() - (time.monotonic() - last_stream))
        idle_for = loop.time() - self._busy_at
        if idle_for < timeout:
            self._arm(max(timeout - idle_for, timeout / 8))
            return
        log.debug("closing idle gRPC connection", server=self._cap.name, idle_s=round(idle_for, 1))
        protocol.goaway_and_close()


class _Mapping:
    """A grpclib servable over an already built method mapping."""

    def __init__(self, mapping: dict[str, Handler]) -> None:
        self._mapping = mapping

    def __mapping__(self) -> dict[str, Handler]:
        return self._mapping


class _Server:
    """One run of a :class:`UnixGrpcServer`: grpclib's server, its call gate and its connections.

    Closing an asyncio server (Python 3.11) stops listening but keeps accepted connections,
    and grpclib keeps dispatching new streams on them; a gRPC client that reuses its
    connection would then talk to a stopped server. :meth:`close_connections` ends them.
    """

    def __init__(self, handlers: Sequence[Any], limits: GrpcLimits, *, name: str) -> None:
        mapping: dict[str, Handler] = {}
        for servable in handlers:
            mapping.update(servable.__mapping__())
        self.gate = CallGate(limits, name=name)
        self.connections = ConnectionCap(limits.max_connections, name=name)
        # h2 lets a peer open 100 streams at once per connection; every one that reaches
        # grpclib costs a task and a response, so a burst of them is one long loop iteration
        settings = Http2Settings(
            max_concurrent_streams=limits.max_streams_per_connection, window_bytes=limits.window_bytes
        )
        self._limits = limits
        self._grpc = make_server([_Mapping(self.gate.wrap(mapping))], settings=settings, accept=self._accept)

    def _accept(self, protocol: ServerProtocol) -> _Connection:
        return _Connection(protocol, self.connections, self._limits)

    async def start(self, path: str) -> None:
        await self._grpc.start(path=path)

    def close(self) -> None:
        self._grpc.close()

    async def wait_closed(self) -> None:
        await self._grpc.wait_closed()

    def close_connections(self) -> None:
        for connection in list(self.connections.open):
            connection.close()  # the transport flushes what was written, then closes


class UnixGrpcServer:
    """A grpclib :class:`Server` listening on a Unix socket file.

    ``handlers`` are grpclib servables (objects with ``__mapping__``). Use as an async context
    manager, or call :meth:`start` and :meth:`close` yourself.
    """

    def __init__(
        self, path: Path, handlers: Sequence[Any], *, close_timeout: float = 2.0, limits: GrpcLimits | None = None
    ) -> None:
        self.path = path
        self._handlers = list(handlers)
        self._close_timeout = close_timeout
        self.limits = limits or GrpcLimits()
        self._server: _Server | None = None
        self._inode: int | None = None

    @property
    def serving(self) -> bool:
        return self._server is not None

    def socket_present(self) -> bool:
        """Whether the file this server listens on is still reachable at ``path``."""
        return self._inode is not None and _inode(self.path) == self._inode

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError(f"server on {self.path} is already started")
        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH:
            raise StartupError(f"socket path {self.path} is longer than {MAX_SOCKET_PATH} bytes")
        try:
            self.path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
            if await remove_stale_socket(self.path):
                log.info("removed stale socket", path=str(self.path))
            server = _Server(self._handlers, self.limits, name=self.path.name)
            await server.start(str(self.path))
        except OSError as exc:
            raise StartupError(f"cannot listen on {self.path}: {exc.strerror or exc}") from exc
        self._server = server
        self._inode = _inode(self.path)

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        try:
            # handlers were cancelled by close(); a handler that swallows cancellation must
            # not hold up a restart forever
            async with asyncio.timeout(self._close_timeout):
                await server.wait_closed()
        except TimeoutError:
            log.warning("gRPC handlers did not finish in time", path=str(self.path), timeout_s=self._close_timeout)
        finally:
            server.close_connections()
            if self._inode is not None and _inode(self.path) == self._inode:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            self._inode = None

    async def __aenter__(self) -> UnixGrpcServer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
