"""A rude gRPC peer: raw HTTP/2 frames over a Unix socket, built with h2.

grpcio only sends well-formed messages; this client sends what a broken or hostile peer can:
a length prefix that lies, a body cut short, garbage, a compressed flag, or nothing at all
after the headers. It is as rude as the peer it stands for: it never closes politely unless told.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from dataclasses import dataclass
from pathlib import Path

import h2.config
import h2.connection
import h2.events

SERVICE = "/v1beta1.DevicePlugin"


def frame(body: bytes, *, compressed: bool = False, length: int | None = None) -> bytes:
    """A gRPC length-prefixed message; ``length`` may lie about ``body``."""
    return struct.pack(">BI", int(compressed), len(body) if length is None else length) + body


@dataclass
class Answer:
    status: int | None  # grpc-status, None if the stream was reset or the connection closed
    message: str
    reset: bool = False


class RawGrpc:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self._h2.initiate_connection()
        self._flush()

    @classmethod
    async def connect(cls, path: Path) -> RawGrpc:
        reader, writer = await asyncio.open_unix_connection(str(path))
        return cls(reader, writer)

    def _flush(self) -> None:
        data = self._h2.data_to_send()
        if data:
            self._writer.write(data)

    def start(self, method: str, data: bytes = b"", *, end: bool = True) -> int:
        """Open a call to ``method`` (e.g. ``Allocate``), send ``data`` raw; returns the stream id."""
        stream_id = self._h2.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", f"{SERVICE}/{method}"),
            (":authority", "localhost"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        self._h2.send_headers(stream_id, headers, end_stream=end and not data)
        if data:
            self._h2.send_data(stream_id, data, end_stream=end)
        self._flush()
        return stream_id

    async def answer(self, stream_id: int, within_s: float = 5.0) -> Answer:
        """The call's status: from trailers (or a trailers-only response), or a reset."""
        status: int | None = None
        message = ""
        async with asyncio.timeout(within_s):
            while True:
                data = await self._reader.read(65536)
                if not data:
                    return Answer(status, message, reset=status is None)
                for event in self._h2.receive_data(data):
                    if isinstance(event, h2.events.DataReceived):
                        self._h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    if getattr(event, "stream_id", None) != stream_id:
                        continue
                    if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                        fields = dict(event.headers)
                        if "grpc-status" in fields:
                            status = int(fields["grpc-status"])
                            message = fields.get("grpc-message", "")
                    elif isinstance(event, h2.events.StreamEnded):
                        self._flush()
                        return Answer(status, message)
                    elif isinstance(event, h2.events.StreamReset):
                        return Answer(status, message, reset=status is None)
                self._flush()

    async def call(self, method: str, data: bytes = b"", within_s: float = 5.0) -> Answer:
        return await self.answer(self.start(method, data), within_s)

    async def events(self, within_s: float = 5.0) -> list[h2.events.Event]:
        """What the server's first answer to this connection holds, up to its SETTINGS at least."""
        events: list[h2.events.Event] = []
        async with asyncio.timeout(within_s):
            while not any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events):
                data = await self._reader.read(65536)
                if not data:
                    break
                events += self._h2.receive_data(data)
        self._flush()
        return events

    async def events_until_closed(self, within_s: float = 5.0) -> list[h2.events.Event]:
        """Every frame's event from now until the server closes the connection."""
        events: list[h2.events.Event] = []
        async with asyncio.timeout(within_s):
            while data := await self._reader.read(65536):
                events += self._h2.receive_data(data)
                self._flush()
        return events

    async def closed_by_peer(self, within_s: float) -> bool:
        """Whether the server closes this connection within ``within_s`` (reads and drops its frames)."""
        try:
            async with asyncio.timeout(within_s):
                while await self._reader.read(65536):
                    pass
        except TimeoutError:
            return False
        except ConnectionError:
            pass
        return True

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()


async def silent_connection(path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that never sends a byte (not even the HTTP/2 preface)."""
    return await asyncio.open_unix_connection(str(path))
