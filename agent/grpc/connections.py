"""A cap on the connections a server holds open at once, for any asyncio protocol.

A server's protocol factory wraps each new protocol in :class:`CappedProtocol`. At the cap, a
new connection makes room by closing the open connection that has been quiet the longest among
those not busy (no call or request in progress): a peer that opens thousands of silent
connections then only ever displaces its own, and never locks out the kubelet or a probe that
connects after it, while a busy connection (the kubelet's ListAndWatch stream) is never cut.
Only when every open connection is busy is the new one refused: closed as soon as it is
accepted, after ``refusal`` bytes (an HTTP 503). Either way the count never exceeds the cap.
Used by the gRPC servers (:mod:`agent.grpc.sockets`) and the debug endpoint; what they do is logged
at most once per ten seconds, with a count.
"""

from __future__ import annotations

import asyncio

import structlog

from agent.base.logs import LogThrottle

log = structlog.get_logger("agent.connections")


class ConnectionCap:
    def __init__(self, limit: int, *, name: str, refusal: bytes = b"") -> None:
        self.limit = limit
        self.name = name
        self.refusal = refusal
        #: in the order admitted (a dict as an ordered set): among connections equally quiet, as a
        #: clock with millisecond steps (uvloop's) makes many, the oldest goes first
        self.open: dict[CappedProtocol, None] = {}
        self.displaced = 0
        self.refused = 0
        self._displace_log = LogThrottle()
        self._refuse_log = LogThrottle()

    def admit(self, connection: CappedProtocol) -> bool:
        if len(self.open) >= self.limit:
            quiet = [c for c in self.open if not c.busy()]
            if not quiet:
                self.refused += 1
                if count := self._refuse_log.due():
                    log.warning("connection refused: every open connection is busy", server=self.name, count=count)
                return False
            victim = min(quiet, key=lambda c: c.last_active)
            del self.open[victim]
            victim.close()
            self.displaced += 1
            if count := self._displace_log.due():
                log.warning(
                    "too many open connections: closed the one quiet the longest",
                    server=self.name,
                    limit=self.limit,
                    count=count,
                )
        self.open[connection] = None
        return True


class CappedProtocol(asyncio.Protocol):
    """``inner`` once the cap admits the connection; nothing (and a closed transport) otherwise.

    With ``start_on_data`` the inner protocol sees the connection only once the peer sends its
    first bytes, so a silent connection costs an accepted socket and nothing more (setting up
    grpclib's HTTP/2 state for each of 1,500 silent connections took the loop 0.2 s).
    Subclasses say when their connection is :meth:`busy`; ``last_active`` is when it last
    received data.
    """

    def __init__(self, inner: asyncio.Protocol, cap: ConnectionCap, *, start_on_data: bool = False) -> None:
        self._inner = inner
        self._cap = cap
        self._start_on_data = start_on_data
        self._transport: asyncio.BaseTransport | None = None
        self.admitted = False
        self.started = False
        self.last_active = 0.0

    def busy(self) -> bool:
        return False

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.last_active = asyncio.get_running_loop().time()
        if not self._cap.admit(self):
            # uvloop's transports are not asyncio.WriteTransport subclasses: ask for write itself
            write = getattr(transport, "write", None)
            if self._cap.refusal and callable(write):
                write(self._cap.refusal)
            transport.close()
            return
        self.admitted = True
        self._transport = transport
        if not self._start_on_data:
            self._start(transport)

    def _start(self, transport: asyncio.BaseTransport) -> None:
        self.started = True
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        self.last_active = asyncio.get_running_loop().time()
        if not self.started and self._transport is not None:
            self._start(self._transport)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self.started else None

    def pause_writing(self) -> None:
        if self.started:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self.started:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.admitted:
            return
        self.admitted = False
        self._transport = None
        self._cap.open.pop(self, None)
        if self.started:
            self._inner.connection_lost(exc)
