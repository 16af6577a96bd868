"""The one module in ``agent/`` that touches grpclib's and h2's internals, behind a small surface.

grpclib 0.4 offers no public way to do six things the gRPC servers need, so each is done here,
against the exact versions below (pinned in pyproject.toml; ``tests/test_grpclib_adapter.py``
fails, naming what to re-check, when the installed ones differ), and nowhere else:

* open every connection with our HTTP/2 settings in the first SETTINGS frame
  (:class:`Http2Settings`, :class:`ServerProtocol`);
* write through a :class:`~agent.grpc.coalesce.CoalescingTransport` (:class:`ServerProtocol`);
* hand each accepted connection to a wrapper of ours, the connection cap and idle timer
  (:func:`make_server`'s ``accept``);
* tell whether a connection has calls open, and when it last opened one, and end it with a
  GOAWAY (:meth:`ServerProtocol.open_streams`, :meth:`~ServerProtocol.last_stream_started`,
  :meth:`~ServerProtocol.goaway_and_close`);
* read a request's bytes before grpclib decodes them, to see its length prefix
  (:func:`recv_data`);
* know which connection a call came on (:func:`connection_of`).

The rest of ``agent/`` uses grpclib's public API only (``grpclib.server.Server`` and
``Stream``, ``GRPCError``, ``grpclib.const``, ``grpclib.client.Channel``, ...) and never imports
h2; ``tests/test_grpclib_adapter.py`` checks that too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass
from typing import Any, cast

from grpclib.config import Configuration
from grpclib.protocol import Connection, EventsProcessor, H2Protocol
from grpclib.server import Server, Stream
from h2.connection import H2Connection
from h2.settings import SettingCodes, Settings

from agent.grpc.coalesce import CoalescingTransport

#: the releases this module was written and tested against
GRPCLIB_VERSION = "0.4.9"
H2_VERSION = "4.4.1"

#: what to read again in a new grpclib or h2 before changing the versions above: each is used here
#: (paths in vmagamedov/grpclib at tag v0.4.9 and python-hyper/h2 at tag v4.4.1)
RECHECK = (
    "grpclib/protocol.py H2Protocol.connection_made: ServerProtocol.connection_made reproduces it",
    "grpclib/protocol.py H2Protocol.__init__(handler, config, h2_config): make_server rebuilds the protocol",
    "grpclib/server.py Server._protocol_factory: overridden by make_server, which calls it first",
    "grpclib/protocol.py EventsProcessor.streams and Connection.last_stream_created: open_streams, last_stream_started",
    "grpclib/protocol.py Connection._connection (the H2Connection), flush, close: goaway_and_close",
    "grpclib/server.py Stream._stream and grpclib/protocol.py Stream.recv_data, Buffer.read "
    "(AssertionError when the stream ends inside a read): recv_data",
    "grpclib/protocol.py Peer._transport, one per connection: connection_of",
    "src/h2/connection.py H2Connection.__init__ (local_settings, DEFAULT_MAX_HEADER_LIST_SIZE), "
    "initiate_connection, increment_flow_control_window; src/h2/settings.py Settings(initial_values=): "
    "ServerProtocol.connection_made",
)

MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Http2Settings:
    """What a server announces on every connection, in its first SETTINGS frame.

    The defaults are what grpclib and h2 announce by themselves.
    """

    #: MAX_CONCURRENT_STREAMS (h2's default: 100)
    max_concurrent_streams: int = 100
    #: the flow-control window of each stream (INITIAL_WINDOW_SIZE) and of the connection
    #: (a WINDOW_UPDATE right after the SETTINGS); grpclib's default: 4 MiB
    window_bytes: int = 4 * MiB


class ServerProtocol(H2Protocol):
    """grpclib's server protocol, writing once per loop turn and opening with every setting.

    Writes go through :class:`~agent.grpc.coalesce.CoalescingTransport`. grpclib opens with h2's
    defaults (100 concurrent streams, 64 KiB stream windows) and sends ours in later SETTINGS
    frames; until the peer reads those, the two sides hold different stream caps. A peer acts on
    the first frame it reads, and h2 enforces a later frame's values from the peer's first ACK
    on (``Settings.acknowledge`` applies one pending value per ACK, whatever frame it answers).
    grpcio then dispatched the calls waiting for a new connection under 100, refused those over
    our cap inside its own transport and retried them on the same connection at once, a loop
    that left every call unwritten until its deadline; and streams a peer opened under 100 ended
    the connection (h2 takes a stream over its cap for a connection error). Opening with the cap
    and the window leaves nothing to disagree on and nothing pending (issue 19).

    Built only by :func:`make_server`. The methods below may be called once
    ``connection_made`` has run.
    """

    def __init__(self, inner: H2Protocol, settings: Http2Settings) -> None:
        super().__init__(inner.handler, inner.config, inner.h2_config)
        self._max_streams = settings.max_concurrent_streams

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # grpclib's H2Protocol.connection_made, with the settings in place before
        # initiate_connection sends them (Unix sockets only, so no TCP_NODELAY)
        h2 = H2Connection(config=self.h2_config)
        values = {
            SettingCodes.MAX_CONCURRENT_STREAMS: self._max_streams,
            SettingCodes.MAX_HEADER_LIST_SIZE: h2.DEFAULT_MAX_HEADER_LIST_SIZE,
            SettingCodes.INITIAL_WINDOW_SIZE: self.config.http2_stream_window_size,
        }
        h2.local_settings = Settings(client=False, initial_values=values)
        h2.initiate_connection()
        # the connection's own window is no setting: it opens at 64 KiB and grows by WINDOW_UPDATE
        increment = self.config.http2_connection_window_size - h2.inbound_flow_control_window
        if increment > 0:
            h2.increment_flow_control_window(increment)
        writes = CoalescingTransport(transport, asyncio.get_running_loop())
        self.connection = Connection(h2, cast(asyncio.Transport, writes), config=self.config)
        self.connection.flush()
        self.connection.initialize()
        self.processor = EventsProcessor(self.handler, self.connection)

    def open_streams(self) -> int:
        """How many calls are open on this connection (a stream counts until grpclib releases it)."""
        return len(self.processor.streams)

    def last_stream_started(self) -> float | None:
        """When the last call on this connection opened (``time.monotonic()``), None before any."""
        return self.connection.last_stream_created

    def goaway_and_close(self) -> None:
        """Send a GOAWAY, then close the connection; what was written before still leaves first."""
        with contextlib.suppress(Exception):  # a GOAWAY is a courtesy; the close is what matters
            self.connection._connection.close_connection()
            self.connection.flush()
        self.connection.close()


class _Server(Server):
    """grpclib's server, its protocols made :class:`ServerProtocol`s and handed to ``accept``."""

    def __init__(
        self,
        handlers: Collection[Any],
        *,
        settings: Http2Settings,
        accept: Callable[[ServerProtocol], asyncio.Protocol],
    ) -> None:
        window = settings.window_bytes
        config = Configuration(http2_connection_window_size=window, http2_stream_window_size=window)
        super().__init__(handlers, config=config)
        self._agent_settings = settings
        self._agent_accept = accept

    def _protocol_factory(self) -> asyncio.Protocol:  # type: ignore[override]
        # grpclib's factory registers the connection's request handler, which close() cancels
        # and wait_closed() waits for; the protocol it returns gives its parts to ours
        protocol = ServerProtocol(super()._protocol_factory(), self._agent_settings)
        return self._agent_accept(protocol)


def make_server(
    handlers: Collection[Any],
    *,
    settings: Http2Settings,
    accept: Callable[[ServerProtocol], asyncio.Protocol] = lambda protocol: protocol,
) -> Server:
    """A grpclib :class:`Server` for ``handlers`` (servables), announcing ``settings``.

    Each accepted connection is a :class:`ServerProtocol`, passed to ``accept``; the protocol
    ``accept`` returns is what the event loop talks to (it must pass every call on to the
    ``ServerProtocol``). Start, close and wait for it through grpclib's public API.
    """
    return _Server(handlers, settings=settings, accept=accept)


class TruncatedData(Exception):
    """The client's stream ended inside the bytes a :func:`recv_data` asked for."""


async def recv_data(stream: Stream[Any, Any], size: int) -> bytes:
    """The next ``size`` bytes of a call's request data, as sent (prefixes included); ``b""`` at its end.

    Reading here instead of ``stream.recv_message()`` sees a message's length prefix before its
    body is read (grpclib has no receive limit). Raises :class:`TruncatedData` when the client's
    stream ends after some but not all of the bytes.
    """
    try:
        return await stream._stream.recv_data(size)
    except AssertionError:  # grpclib's Buffer.read: "Received less data than expected"
        raise TruncatedData(f"the stream ended inside {size} bytes") from None


def connection_of(stream: Stream[Any, Any]) -> Hashable:
    """The HTTP/2 connection a call came on, as an identity key: equal for every call on it.

    grpclib gives each call a new ``Peer`` holding the connection's transport (ours, the
    connection's :class:`~agent.grpc.coalesce.CoalescingTransport`); the transport is the key.
    """
    transport: Hashable = stream.peer._transport
    return transport
