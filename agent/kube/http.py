"""HTTP/1.1 for the API client: one pool of keep-alive connections on asyncio streams.

:class:`HttpPool` speaks to one origin (the API server) and nothing else: no redirects, no
cookies, no proxies, no compression (``Accept-Encoding: identity``), no HTTP/2. It exists
because the client needs only this much, and aiohttp, which did it before, cost 8 MiB of
resident memory with its dependencies (``docs/performance.md``, Memory). The message syntax is
RFC 9112's; what it reads is bounded, because the other end may be anything that answers on
the port:

* a response's status line and headers: :data:`HEAD_BYTES` in all (also the stream's buffer
  limit, so no single line is read further), at most :data:`MAX_HEADERS` headers; the same
  bounds for chunked trailers (RFC 9112 section 7.1.2);
* a body: :meth:`Response.read` stops at the caller's limit (a declared ``Content-Length`` over
  it is refused before reading), :meth:`Response.chunks` hands the body on as it arrives, at
  most :data:`READ_BYTES` at a time, whatever a chunk size line claims; a chunk size line is at
  most 16 hex digits;
* time: the connect (TCP and TLS) is bounded here (:class:`ConnectTimeout`); every wait for the
  next bytes of an answer by ``read_idle_s`` when the caller gives one; the caller wraps a
  request in its own total deadline.

Connections: at most ``max_connections`` open (in use or idle); a request waits for one past
that. An idle one is kept ``keepalive_s`` and reused most recent first; one the server closed
meanwhile is noticed before reuse. A request that finds its reused connection closed before any
byte of an answer is sent again once on a new connection when its method is idempotent (RFC 9110
section 9.2.2; RFC 9112 section 9.3.1: the server may close an idle connection while the request
is on its way). A response read to its end returns its connection to the pool; anything else (an
error, a cancellation, a body left unread) closes it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import ssl
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

_T = TypeVar("_T")

#: status line and headers together; also the stream's buffer limit (the longest line read)
HEAD_BYTES = 64 * 1024
MAX_HEADERS = 128
#: the most :meth:`Response.chunks` hands on at once
READ_BYTES = 64 * 1024
#: methods that are safe to send again on a new connection (RFC 9110 section 9.2.2)
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
#: interim (1xx) answers skipped before the real one (RFC 9110 section 15.2)
MAX_INTERIM = 4
#: a chunk size line's digits: 16 hex digits are 2**64, far past any limit a caller gives
CHUNK_SIZE_DIGITS = 16

_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) (\d{3})(?: (.*))?")
#: RFC 9110 section 5.6.2
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEX = re.compile(rb"[0-9A-Fa-f]+")


class HttpError(Exception):
    """Base of this module's errors."""


class HttpProtocolError(HttpError, ValueError):
    """The server's answer is not HTTP/1.1 this client understands, or is over a bound."""


class BodyTooLarge(HttpError, ValueError):
    """A body is over the caller's limit; ``declared`` when its Content-Length said so up front."""

    def __init__(self, limit: int, declared: int | None = None) -> None:
        super().__init__(f"body over {limit} bytes" if declared is None else f"body of {declared} bytes over {limit}")
        self.limit = limit
        self.declared = declared


class ConnectTimeout(HttpError, TimeoutError):
    """No connection (TCP and TLS) within the connect limit."""


class ServerDisconnected(HttpError, ConnectionError):
    """The server closed the connection before the answer was complete."""


class TlsError(HttpError, ConnectionError):
    """The TLS handshake failed: a certificate not trusted, a name not matched, a protocol refused.

    Retrying does not help: the server will present the same certificate again."""


class PoolClosed(HttpError, ConnectionError):
    """The pool was closed; no more requests."""


class _Stale(Exception):
    """A reused connection was found closed before any byte of the answer (internal)."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where requests go: scheme, host, port, and a path prefix (some proxies serve the API under one)."""

    scheme: str
    host: str
    port: int
    base_path: str

    @classmethod
    def parse(cls, server: str) -> Origin:
        """``server`` as a kubeconfig has it; ValueError when it is not an http(s) URL."""
        parts = urlsplit(server)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {server[:200]!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

    @property
    def host_header(self) -> str:
        """The Host header (RFC 9110 section 7.2): the port only when not the scheme's default."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


class _Connection:
    __slots__ = ("idle_handle", "reader", "reused", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.reused = False
        self.idle_handle: asyncio.TimerHandle | None = None

    def usable(self) -> bool:
        """Not closed by the server, and nothing unasked-for waiting (a server may send a 408 and close)."""
        if self.reader.at_eof() or self.writer.is_closing() or self.reader.exception() is not None:
            return False
        # CPython's StreamReader keeps received bytes in ``_buffer``; no public way to ask
        return not getattr(self.reader, "_buffer", b"")

    def close(self) -> None:
        """Drop the connection at once: nothing more is sent or read on it."""
        self.stop_idle()
        self.writer.transport.abort()

    def stop_idle(self) -> None:
        if self.idle_handle is not None:
            self.idle_handle.cancel()
            self.idle_handle = None


class Response:
    """One answer: status and headers read, the body still on the connection."""

    def __init__(
        self,
        connection: _Connection,
        status: int,
        reason: str,
        headers: dict[str, str],
        *,
        keep_alive: bool,
        no_body: bool,
        read_idle_s: float | None,
    ) -> None:
        self.status = status
        self.reason = reason
        #: lower-case names; a repeated header's values joined with ", "
        self.headers = headers
        self.content_length: int | None = None
        self.read_idle_s = read_idle_s
        self._connection = connection
        self._chunked = False
        self._keep_alive = keep_alive
        #: the body was read to its end: the connection may serve another request
        self.complete = no_body
        if no_body:
            return
        encoding = headers.get("transfer-encoding")
        if encoding is not None:
            # RFC 9112 section 6.3: chunked must be last; it overrides any Content-Length, and
            # then the connection is not reused
            if encoding.split(",")[-1].strip().lower() != "chunked":
                raise HttpProtocolError(f"unsupported Transfer-Encoding {encoding[:40]!r}")
            self._chunked = True
            if "content-length" in headers:
                self._keep_alive = False
        elif "content-length" in headers:
            self.content_length = _content_length(headers["content-length"])
            self.complete = self.content_length == 0
        else:
            self._keep_alive = False  # the body ends when the server closes (RFC 9112 section 6.3)

    @property
    def reusable(self) -> bool:
        """Read to its end on a connection the server keeps open."""
        return self.complete and self._keep_alive

    async def read(self, limit: int) -> bytes:
        """The whole body; BodyTooLarge past ``limit`` bytes (reading stops there)."""
        if self.complete:
            return b""
        if self.content_length is not None:
            if self.content_length > limit:
                raise BodyTooLarge(limit, self.content_length)
            if self.read_idle_s is None:  # one read; the caller's deadline bounds it
                data = await _within(None, self._connection.reader.readexactly(self.content_length))
                self.complete = True
                return data
        body = bytearray()
        async for piece in self.chunks():
            body += piece
            if len(body) > limit:
                raise BodyTooLarge(limit)
        return bytes(body)

    async def read_some(self, limit: int) -> bytes:
        """Up to ``limit`` bytes of the body, for an error message; what does not fit is left unread."""
        if self.content_length is not None and self.content_length <= limit:
            return await self.read(limit)
        body = bytearray()
        async for piece in self.chunks():
            body += piece[: limit - len(body)]
            if len(body) >= limit:
                break
        return bytes(body)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, at most :data:`READ_BYTES` at a time."""
        reader = self._connection.reader
        if self.complete:
            return
        if self._chunked:
            while True:
                size = await self._chunk_size()
                if size == 0:
                    await self._trailers()
                    self.complete = True
                    return
                while size:
                    piece = await self._wait(reader.read(min(size, READ_BYTES)))
                    if not piece:
                        raise ServerDisconnected("the server closed the connection within a chunk")
                    size -= len(piece)
                    yield piece
                if await self._wait(reader.readexactly(2)) != b"\r\n":
                    raise HttpProtocolError("a chunk does not end in CRLF")
        elif self.content_length is not None:
            left = self.content_length
            while left:
                piece = await self._wait(reader.read(min(left, READ_BYTES)))
                if not piece:
                    raise ServerDisconnected("the server closed the connection before the body's end")
                left -= len(piece)
                yield piece
            self.complete = True
        else:
            while piece := await self._wait(reader.read(READ_BYTES)):
                yield piece
            self.complete = True

    async def _chunk_size(self) -> int:
        """RFC 9112 section 7.1: hex digits, then optional extensions (ignored)."""
        line = await self._line()
        text = line.split(b";", 1)[0].strip(b" \t")
        if not _HEX.fullmatch(text) or len(text) > CHUNK_SIZE_DIGITS:
            raise HttpProtocolError(f"bad chunk size line {line[:40]!r}")
        return int(text, 16)

    async def _trailers(self) -> None:
        total = 0
        for _ in range(MAX_HEADERS + 1):
            line = await self._line()
            if not line:
                return
            total += len(line) + 2
            if total > HEAD_BYTES:
                break
        raise HttpProtocolError(f"trailer fields over {MAX_HEADERS} or {HEAD_BYTES} bytes")

    async def _line(self) -> bytes:
        return (await self._wait(self._connection.reader.readuntil(b"\r\n")))[:-2]

    async def _wait(self, step: Awaitable[_T]) -> _T:
        return await _within(self.read_idle_s, step)


async def _within(idle_s: float | None, step: Awaitable[_T]) -> _T:
    """``step`` within ``idle_s``; a closed connection or an endless line as this module's errors."""
    try:
        if idle_s is None:
            return await step
        async with asyncio.timeout(idle_s):
            return await step
    except asyncio.IncompleteReadError as exc:
        raise ServerDisconnected("the server closed the connection before the answer's end") from exc
    except asyncio.LimitOverrunError as exc:
        raise HttpProtocolError(f"a line longer than {HEAD_BYTES} bytes") from exc


def _content_length(value: str) -> int:
    """RFC 9112 section 6.3: digits only; a list of equal values counts once, unequal ones are an error."""
    values = {v.strip() for v in value.split(",")}
    if len(values) != 1:
        raise HttpProtocolError(f"conflicting Content-Length {value[:40]!r}")
    text = values.pop()
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        raise HttpProtocolError(f"bad Content-Length {value[:40]!r}")
    return int(text)


async def _read_head(reader: asyncio.StreamReader, idle_s: float | None) -> tuple[int, str, dict[str, str], bool]:
    """Status, reason, headers and whether HTTP/1.1 keep-alive applies; interim answers skipped.

    Raises :class:`_Stale` when the connection ends before the first byte."""
    first = True
    for _ in range(MAX_INTERIM + 1):
        total = 0
        try:
            line = await _within(idle_s, reader.readuntil(b"\r\n"))
        except ServerDisconnected as exc:
            partial = exc.__cause__
            if first and isinstance(partial, asyncio.IncompleteReadError) and not partial.partial:
                raise _Stale from exc
            raise
        except ConnectionResetError as exc:
            if first:
                raise _Stale from exc
            raise
        first = False
        total += len(line)
        match = _STATUS_LINE.fullmatch(line[:-2])
        if match is None:
            raise HttpProtocolError(f"not an HTTP/1.x status line: {line[:60]!r}")
        minor, code, reason = match.groups()
        status = int(code)
        headers: dict[str, str] = {}
        count = 0
        while True:
            line = await _within(idle_s, reader.readuntil(b"\r\n"))
            total += len(line)
            if total > HEAD_BYTES:
                raise HttpProtocolError(f"status line and headers over {HEAD_BYTES} bytes")
            if line == b"\r\n":
                break
            count += 1
            if count > MAX_HEADERS:
                raise HttpProtocolError(f"more than {MAX_HEADERS} headers")
            name, sep, value = line[:-2].partition(b":")
            if not sep or not _TOKEN.fullmatch(name):  # obs-fold and junk alike (RFC 9112 section 5.2)
                raise HttpProtocolError(f"malformed header line {line[:60]!r}")
            key = name.decode("ascii").lower()
            text = value.strip(b" \t").decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        if 100 <= status < 200:
            if status == 101:
                raise HttpProtocolError("the server switched protocols")
            continue
        connection = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        keep_alive = "keep-alive" in connection if minor == b"0" else "close" not in connection
        return status, (reason or b"").decode("latin-1"), headers, keep_alive
    raise HttpProtocolError(f"more than {MAX_INTERIM} interim answers")


def _checked(text: str, what: str) -> str:
    """No CR, LF or NUL: a header or target that could split the request (RFC 9110 section 5.5)."""
    if any(c in text for c in "\r\n\0"):
        raise ValueError(f"{what} contains a line break: {text[:60]!r}")
    return text


class HttpPool:
    """Keep-alive connections to one origin; see the module docstring for the rules."""

    def __init__(
        self,
        server: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        max_connections: int = 16,
        keepalive_s: float = 75.0,
        connect_timeout_s: float = 10.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self.origin = Origin.parse(server)
        if self.origin.scheme == "https" and ssl_context is None:
            raise ValueError("an https origin needs an SSL context")
        self._ssl = ssl_context if self.origin.scheme == "https" else None
        self._server_hostname = server_hostname or self.origin.host
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self._default_headers = {"User-Agent": "gpu-node-agent", "Accept-Encoding": "identity", **(headers or {})}
        #: idle connections, the most recently used last
        self._idle: list[_Connection] = []
        self._in_use: set[_Connection] = set()
        #: connections open or being opened (in use, idle, connecting)
        self._open = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False
        #: connections opened so far (for tests and benchmarks)
        self.connects = 0

    @property
    def open_connections(self) -> int:
        return self._open

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    async def close(self) -> None:
        """Close every connection; requests in flight fail. Idempotent."""
        self._closed = True
        for connection in [*self._idle, *self._in_use]:
            connection.close()
        self._idle.clear()
        self._in_use.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # wakes to find the pool closed
        await asyncio.sleep(0)  # let the transports' close callbacks run

    @contextlib.asynccontextmanager
    async def request(
        self,
        method: str,
        target: str,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
        *,
        read_idle_s: float | None = None,
    ) -> AsyncIterator[Response]:
        """Send a request; yields the response with its body unread.

        ``target`` is the path and query (``/api/v1/nodes?limit=1``), put after the origin's
        path prefix. Leaving the block returns the connection to the pool when the body was
        read to its end, and closes it otherwise."""
        payload = self._encode(method, target, headers or {}, body)
        for attempt in (1, 2):
            connection = await self._checkout(fresh=attempt > 1)
            try:
                response = await self._exchange(connection, method, payload, read_idle_s)
            except _Stale as exc:
                self._discard(connection)
                if attempt == 1 and method in IDEMPOTENT:
                    continue
                raise ServerDisconnected("the server closed the connection before answering") from exc.__cause__
            except BaseException:
                self._discard(connection)
                raise
            break
        try:
            yield response
        except BaseException:
            self._discard(connection)
            raise
        if response.reusable:
            self._release(connection)
        else:
            self._discard(connection)

    def _encode(self, method: str, target: str, headers: Mapping[str, str], body: bytes | None) -> bytes:
        if not _TOKEN.fullmatch(method.encode("ascii", errors="replace")):
            raise ValueError(f"bad method {method[:20]!r}")
        if not target.startswith("/") or " " in target:
            raise ValueError(f"bad request target {target[:60]!r}")
        lines = [
            f"{method} {_checked(self.origin.base_path + target, 'target')} HTTP/1.1",
            f"Host: {self.origin.host_header}",
        ]
        merged = {**self._default_headers, **headers}
        for name, value in merged.items():
            if not _TOKEN.fullmatch(name.encode("ascii", errors="replace")):
                raise ValueError(f"bad header name {name[:40]!r}")
            lines.append(f"{name}: {_checked(value, name)}")
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        return head + (body or b"")

    async def _exchange(
        self, connection: _Connection, method: str, payload: bytes, read_idle_s: float | None
    ) -> Response:
        try:
            connection.writer.write(payload)
            await connection.writer.drain()
        except (ConnectionResetError, BrokenPipeError) as exc:
            if connection.reused:
                raise _Stale from exc
            raise
        try:
            status, reason, headers, keep_alive = await _read_head(connection.reader, read_idle_s)
        except _Stale:
            if connection.reused:
                raise
            raise ServerDisconnected("the server closed the connection before answering") from None
        no_body = method == "HEAD" or status in (204, 304)
        return Response(
            connection, status, reason, headers, keep_alive=keep_alive, no_body=no_body, read_idle_s=read_idle_s
        )

    async def _checkout(self, *, fresh: bool = False) -> _Connection:
        """An idle connection, or a new one when fewer than ``max_connections`` are open; else wait.

        ``fresh``: a new connection (for the retry after a reused one was found closed; others
        idle as long may be closed too), closing the oldest idle one to make room if need be."""
        while True:
            if self._closed:
                raise PoolClosed("the HTTP pool is closed")
            if fresh and self._idle and self._open >= self.max_connections:
                oldest = self._idle.pop(0)
                oldest.stop_idle()
                self._drop(oldest)
            while self._idle and not fresh:
                connection = self._idle.pop()
                connection.stop_idle()
                if connection.usable():
                    connection.reused = True
                    self._in_use.add(connection)
                    return connection
                self._drop(connection)
            if self._open < self.max_connections:
                self._open += 1
                try:
                    connection = await self._connect()
                except BaseException:
                    self._open -= 1
                    self._wake()
                    raise
                self.connects += 1
                if self._closed:  # closed while this one was being opened
                    connection.close()
                    raise PoolClosed("the HTTP pool is closed")
                self._in_use.add(connection)
                return connection
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken and cancelled at once: pass the turn on
                raise
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)

    async def _connect(self) -> _Connection:
        """A new TCP (and TLS) connection within ``connect_timeout_s``."""
        origin = self.origin
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    origin.host,
                    origin.port,
                    ssl=self._ssl,
                    server_hostname=self._server_hostname if self._ssl is not None else None,
                    limit=HEAD_BYTES,
                )
        except TimeoutError as exc:
            raise ConnectTimeout(f"no connection to {origin.host_header} within {self.connect_timeout_s:g}s") from exc
        except ssl.SSLError as exc:
            detail = getattr(exc, "verify_message", None) or exc.reason or str(exc)
            raise TlsError(f"TLS with {origin.host_header} failed: {detail}") from exc
        return _Connection(reader, writer)

    def _release(self, connection: _Connection) -> None:
        self._in_use.discard(connection)
        if self._closed or not connection.usable():
            self._drop(connection)
            return
        loop = asyncio.get_running_loop()
        connection.idle_handle = loop.call_later(self.keepalive_s, self._expire, connection)
        self._idle.append(connection)
        self._wake()

    def _expire(self, connection: _Connection) -> None:
        connection.idle_handle = None
        with contextlib.suppress(ValueError):
            self._idle.remove(connection)
            self._drop(connection)

    def _discard(self, connection: _Connection) -> None:
        if connection in self._in_use:
            self._in_use.discard(connection)
            self._drop(connection)

    def _drop(self, connection: _Connection) -> None:
        connection.close()
        self._open -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
