"""A cap on the connections a server holds open at once, for any asyncio protocol.

A server's protocol factory wraps each new protocol in :class:`CappedProtocol`; while the cap
is full a new connection is closed as soon as it is accepted (after ``refusal`` bytes, e.g. an
HTTP 503), so a peer that opens thousands of connections costs one file descriptor per
connection for a moment only. Used by the gRPC servers (:mod:`agent.sockets`) and the debug
endpoint. Refusals are logged at most once per ten seconds, with a count.
"""

from __future__ import annotations

import asyncio

import structlog

from agent.logs import LogThrottle

log = structlog.get_logger("agent.connections")


class ConnectionCap:
    def __init__(self, limit: int, *, name: str, refusal: bytes = b"") -> None:
        self.limit = limit
        self.name = name
        self.refusal = refusal
        self.open: set[CappedProtocol] = set()
        self.refused = 0
        self._throttle = LogThrottle()

    def admit(self, connection: CappedProtocol) -> bool:
        if len(self.open) >= self.limit:
            self.refused += 1
            count = self._throttle.due()
            if count:
                log.warning(
                    "connection refused: too many open connections", server=self.name, limit=self.limit, count=count
                )
            return False
        self.open.add(connection)
        return True


class CappedProtocol(asyncio.Protocol):
    """``inner`` once the cap admits the connection; nothing (and a closed transport) otherwise."""

    def __init__(self, inner: asyncio.Protocol, cap: ConnectionCap) -> None:
        self._inner = inner
        self._cap = cap
        self.admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._cap.admit(self):
            if self._cap.refusal and isinstance(transport, asyncio.WriteTransport):
                transport.write(self._cap.refusal)
            transport.close()
            return
        self.admitted = True
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.admitted:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self.admitted else None

    def pause_writing(self) -> None:
        if self.admitted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.admitted:
            return
        self.admitted = False
        self._cap.open.discard(self)
        self._inner.connection_lost(exc)
