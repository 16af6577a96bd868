"""One write per loop iteration for a grpclib connection: a response's frames leave in one send.

grpclib writes to the transport after every HTTP/2 step: the window update for a request's
data, then the response's headers, its message and its trailers, each its own ``send(2)`` on
the socket and, on the other side, its own wake-up. :class:`CoalescingTransport` is the transport
the server protocol writes to (:class:`agent.grpc.grpclib_adapter.ServerProtocol` installs it): it
gathers what is written during one turn of the event loop and writes it at the end of that turn
(``loop.call_soon``), in order, as one buffer. Nothing waits longer than the current turn; flow
control is unchanged (the real transport still pauses and resumes the protocol); ``close`` and
``abort`` write or drop what is pending first.
"""

from __future__ import annotations

import asyncio
from typing import Any


class CoalescingTransport:
    """Wraps an asyncio transport: ``write`` buffers until the end of the loop's current turn."""

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._scheduled = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._pending.append(bytes(data))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._flush)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def _flush(self) -> None:
        self._scheduled = False
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        buffered: int = self._transport.get_write_buffer_size()
        return buffered + sum(map(len, self._pending))

    def __getattr__(self, name: str) -> Any:
        # is_closing, get_extra_info, pause_reading, set_write_buffer_limits, ...
        return getattr(self._transport, name)
