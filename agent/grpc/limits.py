"""What a gRPC peer may make one of our servers do: message size and shape, concurrent calls, time.

:class:`UnixGrpcServer` applies this to every handler of every service it serves (the device
plugin, DRA), so a servicer never has to. grpclib 0.4 has no receive limit of its own
(vmagamedov/grpclib#195): it reads a message of any length the 5-byte prefix announces, then
decodes it on the event loop. Here a handler receives through :class:`BoundedStream` instead:

* a message longer than ``max_message_bytes`` is refused from its prefix, before its body is
  read: ``RESOURCE_EXHAUSTED``, as grpc-go answers;
* the body's wire shape is checked (:mod:`agent.grpc.wireshape`) and the message decoded in a worker
  thread, so a request of many small fields never stalls the loop; malformed protobuf, a
  truncated message or too many fields is ``INVALID_ARGUMENT`` (grpclib answered ``UNKNOWN``
  and logged a traceback);
* a request message must arrive whole within ``request_timeout_s`` (a half-sent request held a
  stream forever): ``DEADLINE_EXCEEDED``;
* at most ``max_calls`` calls run at once per server, of them at most ``max_streaming_calls``
  server-streaming ones (ListAndWatch: the kubelet holds one): ``RESOURCE_EXHAUSTED`` past it;
* message bodies larger than ``large_message_bytes`` are read ``max_large_receives`` at a time,
  so the memory they take is bounded whatever the number of calls;
* every status message a handler raises is cut to ``MAX_STATUS_CHARS``: HTTP/2 header encoding
  is quadratic, and one uncut 1 MB device ID in an error froze the agent for minutes.

Refusals are logged at most once per ten seconds per server, with a count.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
from grpclib import GRPCError
from grpclib.const import Handler, Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.server import Stream

from agent.base.logs import LogThrottle
from agent.grpc.grpclib_adapter import TruncatedData, recv_data
from agent.grpc.wireshape import ShapeLimits, WireShapeError, check_shape

log = structlog.get_logger("agent.grpc")

KiB = 1024
MiB = 1024 * KiB
#: longest status message sent; longer ones are cut with a note of how much was cut
MAX_STATUS_CHARS = 512
#: bodies up to this size are decoded on the loop (at most ~32 fields: well under a millisecond)
INLINE_DECODE_BYTES = 64

_PREFIX = struct.Struct(">BI")


@dataclass(frozen=True, slots=True)
class GrpcLimits:
    """Bounds of one gRPC server; the defaults suit the kubelet's device-plugin and DRA calls."""

    #: grpc-go's default receive limit. Nothing the kubelet sends us can legitimately be larger:
    #: its biggest request (GetPreferredAllocation) lists at most the devices our ListAndWatch
    #: advertised, and that message must itself fit the kubelet's own 4 MiB receive limit.
    max_message_bytes: int = 4 * MiB
    #: 65,536 fields: every device ID a 4 MiB ListAndWatch can carry, with room to spare
    shape: ShapeLimits = field(default_factory=ShapeLimits)
    max_calls: int = 64
    #: the kubelet holds one ListAndWatch per resource; a kubelet restart briefly overlaps two
    max_streaming_calls: int = 8
    large_message_bytes: int = 64 * KiB
    max_large_receives: int = 2
    request_timeout_s: float = 10.0
    #: the kubelet keeps one connection per plugin socket (plus one while it restarts)
    max_connections: int = 16
    #: HTTP/2 MAX_CONCURRENT_STREAMS (h2 defaults to 100): the kubelet uses one stream for
    #: ListAndWatch and one at a time for the unary calls
    max_streams_per_connection: int = 16
    #: a connection without an open call for this long is closed (GOAWAY first); the kubelet
    #: reconnects on its next call, and its ListAndWatch connection is never idle
    idle_timeout_s: float = 60.0
    #: HTTP/2 flow-control windows: what a peer may send before we read, per connection/stream
    window_bytes: int = 256 * KiB


def cut(text: str, limit: int = MAX_STATUS_CHARS) -> str:
    """``text`` at most ``limit`` characters long (plus a note of how many were cut)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def status_label(status: Status) -> str:
    """A metrics label for a status: ``INVALID_ARGUMENT`` -> ``invalid-argument``."""
    return status.name.lower().replace("_", "-")


class CallGate:
    """One server's running calls and large receives; builds the bounded handlers."""

    def __init__(self, limits: GrpcLimits, *, name: str) -> None:
        self.limits = limits
        self.name = name
        self.calls = 0
        self.streaming = 0
        self.codec = ProtoCodec()
        self._large = asyncio.Semaphore(limits.max_large_receives)
        self._refusals = LogThrottle()

    def wrap(self, mapping: Mapping[str, Handler]) -> dict[str, Handler]:
        return {method: self._bounded(method, handler) for method, handler in mapping.items()}

    def refused(self, method: str, status: Status, message: str) -> GRPCError:
        count = self._refusals.due()
        if count:
            log.warning(
                "gRPC call refused", server=self.name, method=method, status=status.name, reason=message, count=count
            )
        return GRPCError(status, message)

    @contextlib.contextmanager
    def admit(self, method: str, streaming: bool) -> Iterator[None]:
        limits = self.limits
        if self.calls >= limits.max_calls:
            raise self.refused(method, Status.RESOURCE_EXHAUSTED, f"more than {limits.max_calls} concurrent calls")
        if streaming and self.streaming >= limits.max_streaming_calls:
            raise self.refused(
                method, Status.RESOURCE_EXHAUSTED, f"more than {limits.max_streaming_calls} concurrent streams"
            )
        self.calls += 1
        self.streaming += streaming
        try:
            yield
        finally:
            self.calls -= 1
            self.streaming -= streaming

    def _bounded(self, method: str, handler: Handler) -> Handler:
        serve: Callable[[Any], Awaitable[None]] = handler.func
        streaming = bool(handler.cardinality.server_streaming)

        async def bounded(stream: Stream[Any, Any]) -> None:
            with self.admit(method, streaming):
                try:
                    await serve(BoundedStream(stream, method, handler, self))
                except GRPCError as exc:
                    if exc.message is not None and len(exc.message) > MAX_STATUS_CHARS:
                        raise GRPCError(exc.status, cut(exc.message), exc.details) from exc
                    raise

        return Handler(bounded, handler.cardinality, handler.request_type, handler.reply_type)

    @contextlib.asynccontextmanager
    async def large_receive(self, length: int) -> AsyncIterator[None]:
        if length <= self.limits.large_message_bytes:
            yield
            return
        async with self._large:
            yield

    async def receive(self, stream: Stream[Any, Any], method: str, request_type: type[Any]) -> Any:
        """The next request message, or None at the end of the client's stream."""
        limits = self.limits
        # the raw request data: the only way to see the length prefix before the body is read
        try:
            async with asyncio.timeout(limits.request_timeout_s):
                prefix = await recv_data(stream, _PREFIX.size)
                if not prefix:
                    return None
                if len(prefix) != _PREFIX.size:
                    raise self.refused(method, Status.INVALID_ARGUMENT, "truncated request message")
                compressed, length = _PREFIX.unpack(prefix)
                if compressed:
                    raise self.refused(method, Status.UNIMPLEMENTED, "compressed messages are not supported")
                if length > limits.max_message_bytes:
                    raise self.refused(
                        method,
                        Status.RESOURCE_EXHAUSTED,
                        f"received message larger than max ({length} vs. {limits.max_message_bytes} bytes)",
                    )
                async with self.large_receive(length):
                    body = await recv_data(stream, length)
                    return await self._decode(method, body, length, request_type)
        except TimeoutError:
            raise self.refused(
                method, Status.DEADLINE_EXCEEDED, f"request message not received within {limits.request_timeout_s:g} s"
            ) from None
        except TruncatedData:
            raise self.refused(method, Status.INVALID_ARGUMENT, "truncated request message") from None

    async def _decode(self, method: str, body: bytes, length: int, request_type: type[Any]) -> Any:
        if len(body) != length:
            raise self.refused(method, Status.INVALID_ARGUMENT, "truncated request message")

        def decode() -> Any:
            check_shape(body, request_type, self.limits.shape)
            return self.codec.decode(body, request_type)

        try:
            return decode() if length <= INLINE_DECODE_BYTES else await asyncio.to_thread(decode)
        except WireShapeError as exc:
            raise self.refused(method, Status.INVALID_ARGUMENT, f"{request_type.__name__}: {exc}") from None
        except Exception as exc:  # betterproto: bad UTF-8, a field of the wrong wire type, ...
            reason = f"cannot decode {request_type.__name__}: {type(exc).__name__}"
            raise self.refused(method, Status.INVALID_ARGUMENT, reason) from None


class BoundedStream:
    """What a handler gets instead of grpclib's :class:`Stream`: the same, with a bounded receive.

    A unary-request call whose client sent no message at all is ``INVALID_ARGUMENT`` (grpclib
    would hand the handler ``None``).
    """

    def __init__(self, stream: Stream[Any, Any], method: str, handler: Handler, gate: CallGate) -> None:
        self._stream = stream
        self._method = method
        self._request_type: type[Any] = handler.request_type
        self._client_streaming = bool(handler.cardinality.client_streaming)
        self._gate = gate
        self._received = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    async def recv_message(self) -> Any:
        message = await self._gate.receive(self._stream, self._method, self._request_type)
        if message is None and not self._client_streaming and not self._received:
            raise self._gate.refused(self._method, Status.INVALID_ARGUMENT, "no request message")
        self._received += message is not None
        return message

    def __aiter__(self) -> BoundedStream:
        return self

    async def __anext__(self) -> Any:
        message = await self.recv_message()
        if message is None:
            raise StopAsyncIteration
        return message
