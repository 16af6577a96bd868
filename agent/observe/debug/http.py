"""A small HTTP/1.1 server on asyncio streams, for the agent's local debug endpoint.

Why not aiohttp.web: with its dependencies aiohttp costs about 8 MiB of resident memory, and the
debug endpoint (probes, a Prometheus scrape, a person with curl) needs a few hundred lines of
HTTP/1.1, not a framework. Why not ``http.server``: it blocks a thread per request.

What it speaks (RFC 9112): a request line and header fields, each bounded, then a body framed
by ``Content-Length`` only (a handler reads it when it wants it). ``Transfer-Encoding`` on a
request is refused with 411 and the connection closed: none of the routes takes a body of
unknown length, and accepting both framings is how requests get smuggled (RFC 9112 §6.3, §11.2).
Responses always carry ``Content-Length``. Anything malformed gets one status line and a one-line
text body, then the connection is closed after a short lingering read (RFC 9112 §9.6), so the
client sees the answer rather than a reset.

Keep-alive is kept: a scraper reuses its connection, and an idle connection costs a socket and
a suspended task. It is bounded twice: ``idle_timeout_s`` for the whole next request head (a
client that trickles header bytes, slowloris, is cut when it runs out, not when it stops), and
``max_requests_per_connection``, after which the answer says ``Connection: close``.

Connections are capped with :class:`agent.grpc.connections.ConnectionCap`: a new connection past
the cap displaces the quietest one not answering a request; only when every open connection is
answering is it refused with a 503. The cap needs a protocol that admits or refuses a connection
before any task exists for it, which is why the server is built from ``loop.create_server`` and
``asyncio.StreamReaderProtocol`` (what ``asyncio.start_server`` does inside) rather than
``start_server`` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import structlog

from agent.grpc.connections import CappedProtocol, ConnectionCap

log = structlog.get_logger("agent.debug")


@dataclass(frozen=True, slots=True)
class HttpLimits:
    #: the only body is the simulated-health JSON, a few dozen bytes
    max_body_bytes: int = 64 * 1024
    body_timeout_s: float = 5.0
    #: a connection without a complete request head (silent, half-sent, idle keep-alive) is closed;
    #: also how long a response may take to be sent
    idle_timeout_s: float = 15.0
    #: probes, a Prometheus scrape and a person with curl need a handful
    max_connections: int = 64
    max_line_bytes: int = 8190
    max_header_bytes: int = 8190
    max_headers: int = 32
    #: request line and header fields together
    max_head_bytes: int = 16 * 1024
    #: then ``Connection: close``: no connection lives on one scraper forever
    max_requests_per_connection: int = 100
    #: reading (and dropping) what a refused client still sends, before closing
    linger_s: float = 1.0
    #: at shutdown, how long a request being answered may take to finish
    shutdown_timeout_s: float = 1.0


class ClientGone(ConnectionError):
    """The client closed the connection before its request arrived whole."""


class BodyTimeout(TimeoutError):
    """The request body did not arrive within ``body_timeout_s``."""


@dataclass(frozen=True, slots=True)
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


def text_response(text: str, status: int = 200) -> Response:
    return Response(status, text.encode())


def json_response(value: Any, status: int = 200, dumps: Callable[[Any], str] = json.dumps) -> Response:
    return Response(status, dumps(value).encode(), "application/json; charset=utf-8")


@dataclass(eq=False, slots=True)
class Request:
    method: str
    #: the request target's path (no query), not percent-decoded: the routes are plain ASCII
    path: str
    query: str
    #: lower-case names; a repeated field's values joined with ", " (RFC 9110 §5.3)
    headers: dict[str, str]
    content_length: int
    _reader: asyncio.StreamReader = field(repr=False)
    _writer: asyncio.StreamWriter = field(repr=False)
    _body_timeout_s: float = field(repr=False)
    _body: bytes | None = field(default=None, repr=False)

    @property
    def body_read(self) -> bool:
        return self._body is not None or self.content_length == 0

    async def read(self) -> bytes:
        """The body: ``Content-Length`` bytes (already checked against the limit), within the body
        timeout (:class:`BodyTimeout`); :class:`ClientGone` when the client closes first."""
        if self._body is not None:
            return self._body
        if self.content_length == 0:
            self._body = b""
            return self._body
        if "100-continue" in self.headers.get("expect", "").lower():  # RFC 9110 §10.1.1; curl sends it
            self._writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            async with asyncio.timeout(self._body_timeout_s):
                self._body = await self._reader.readexactly(self.content_length)
        except TimeoutError as exc:
            raise BodyTimeout("request body not received in time") from exc
        except asyncio.IncompleteReadError as exc:
            raise ClientGone("the client closed before its body arrived") from exc
        return self._body

    async def json(self) -> Any:
        """The body as JSON (UTF-8); ValueError when it is not."""
        return json.loads((await self.read()).decode())


Handler = Callable[[Request], Awaitable[Response]]
#: path -> method -> handler; a GET route answers HEAD too, without the body
Routes = Mapping[str, Mapping[str, Handler]]


class HttpError(Exception):
    """A request the server answers itself, then closes the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_TCHAR = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
#: digits of a Content-Length worth converting; longer is past any limit (and int() of a million
#: digits is quadratic)
_MAX_LENGTH_DIGITS = 15


def _is_token(text: str) -> bool:
    return bool(text) and all(c in _TCHAR for c in text)


async def read_head(reader: asyncio.StreamReader, limits: HttpLimits) -> tuple[str, list[tuple[str, str]]] | None:
    """The request line and header fields, each line and all together bounded; None when the
    client closed cleanly before sending anything."""
    request_line: str | None = None
    fields: list[tuple[str, str]] = []
    total = 0
    while True:
        try:
            raw = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            if request_line is None and not exc.partial.strip():
                return None
            raise ClientGone("the client closed in the middle of a request head") from exc
        except asyncio.LimitOverrunError as exc:
            if request_line is None:
                raise HttpError(414, "request line too long") from exc
            raise HttpError(431, "header field too long") from exc
        total += len(raw)
        if total > limits.max_head_bytes:
            raise HttpError(431, "request header fields too large")
        line = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]  # a bare LF ends a line too (RFC 9112 §2.2)
        if request_line is None:
            if not line:
                continue  # empty lines before the request line are ignored (RFC 9112 §2.2)
            if len(line) > limits.max_line_bytes:
                raise HttpError(414, "request line too long")
            request_line = line.decode("latin-1")
            continue
        if not line:
            return request_line, fields
        if len(line) > limits.max_header_bytes:
            raise HttpError(431, "header field too long")
        if len(fields) >= limits.max_headers:
            raise HttpError(400, "too many header fields")
        fields.append(_parse_field(line.decode("latin-1")))


def _parse_field(line: str) -> tuple[str, str]:
    if line[0] in " \t":
        raise HttpError(400, "obsolete line folding is not accepted")  # RFC 9112 §5.2
    name, colon, value = line.partition(":")
    if not colon:
        raise HttpError(400, "header field without a colon")
    if not _is_token(name):  # also whitespace before the colon (RFC 9112 §5.1)
        raise HttpError(400, "invalid header field name")
    value = value.strip(" \t")
    if any(c in value for c in "\r\n\0"):  # RFC 9110 §5.5
        raise HttpError(400, "invalid header field value")
    return name.lower(), value


def parse_request_line(line: str) -> tuple[str, str, str, bool]:
    """Method, path, query and whether HTTP/1.1 (else 1.0) of a request line (RFC 9112 §3)."""
    parts = line.split(" ")
    if len(parts) != 3:
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if not _is_token(method):
        raise HttpError(400, "invalid method")
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        if len(version) == 8 and version.startswith("HTTP/") and version[5::2].isdigit() and version[6] == ".":
            raise HttpError(505, "only HTTP/1.0 and HTTP/1.1 are spoken here")
        raise HttpError(400, "malformed request line")
    if not target.isascii() or not target.isprintable():
        raise HttpError(400, "invalid request target")
    for scheme in ("http://", "https://"):  # absolute-form (RFC 9112 §3.2.2): the path counts
        if target.lower().startswith(scheme):
            slash = target.find("/", len(scheme))
            target = target[slash:] if slash >= 0 else "/"
    if not target.startswith("/"):
        raise HttpError(400, "invalid request target")
    path, _, query = target.partition("?")
    return method, path, query, version == "HTTP/1.1"


def content_length(headers: Mapping[str, str], limit: int) -> int:
    """The body's length from ``Content-Length``; refuses other framings (RFC 9112 §6)."""
    if "transfer-encoding" in headers:
        if "content-length" in headers:
            raise HttpError(400, "both Transfer-Encoding and Content-Length")
        raise HttpError(411, "request bodies need a Content-Length; Transfer-Encoding is not accepted")
    raw = headers.get("content-length")
    if raw is None:
        return 0
    values = {v.strip(" \t") for v in raw.split(",")}  # a repeated equal value is allowed (RFC 9110 §8.6)
    if len(values) != 1:
        raise HttpError(400, "conflicting Content-Length values")
    value = values.pop()
    if not value.isascii() or not value.isdigit():
        raise HttpError(400, "invalid Content-Length")
    if len(value) > _MAX_LENGTH_DIGITS or int(value) > limit:
        raise HttpError(413, f"request body over the limit of {limit} bytes")
    return int(value)


def encode(response: Response, *, head_only: bool = False, keep_alive: bool = True) -> bytes:
    try:
        reason = HTTPStatus(response.status).phrase
    except ValueError:
        reason = "Unknown"
    lines = [
        f"HTTP/1.1 {response.status} {reason}",
        f"Content-Type: {response.content_type}",
        f"Content-Length: {len(response.body)}",
        f"Date: {email.utils.formatdate(usegmt=True)}",
        *(f"{name}: {value}" for name, value in response.headers),
    ]
    if not keep_alive:
        lines.append("Connection: close")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + response.body


_BUSY = encode(text_response("too many open connections", 503), keep_alive=False)


class _Connection(CappedProtocol):
    """One client connection: the cap sees it, its task reads and answers its requests."""

    def __init__(self, server: HttpServer, loop: asyncio.AbstractEventLoop) -> None:
        self._server = server
        self.answering = False
        # one line at most (plus its CR) without an LF before the read fails; the buffer holds twice that
        reader = asyncio.StreamReader(limit=max(server.limits.max_line_bytes, server.limits.max_header_bytes) + 1)
        super().__init__(asyncio.StreamReaderProtocol(reader, self._connected, loop=loop), server.cap)

    def busy(self) -> bool:
        return self.admitted and self.answering

    def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._server.spawn(self, reader, writer)


class HttpServer:
    """Serves ``routes`` on one TCP address; :meth:`start`, then :meth:`close`."""

    def __init__(self, routes: Routes, limits: HttpLimits, *, name: str = "debug") -> None:
        self.routes = routes
        self.limits = limits
        self.cap = ConnectionCap(limits.max_connections, name=name, refusal=_BUSY)
        self._name = name
        self._server: asyncio.Server | None = None
        self._tasks: dict[asyncio.Task[None], _Connection] = {}
        self._serial = 0
        self._closing = False

    async def start(self, host: str, port: int) -> int:
        """Listen; the bound port. OSError when the address cannot be had."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self, loop), host, port, reuse_address=True)
        sockets = self._server.sockets
        return int(sockets[0].getsockname()[1]) if sockets else port

    def spawn(self, connection: _Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing:
            writer.close()
            return
        self._serial += 1
        task = asyncio.get_running_loop().create_task(
            self._serve(connection, reader, writer), name=f"{self._name}-http-{self._serial}"
        )
        self._tasks[task] = connection
        task.add_done_callback(self._tasks.pop)

    async def close(self) -> None:
        """Stop listening, close idle connections, give requests being answered a moment."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for task, connection in list(self._tasks.items()):
            if not connection.answering:
                task.cancel()
        tasks = list(self._tasks)
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=self.limits.shutdown_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.limits.shutdown_timeout_s):
                    await self._server.wait_closed()

    async def _serve(self, connection: _Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        limits = self.limits
        try:
            for served in range(1, limits.max_requests_per_connection + 1):
                connection.answering = False
                try:
                    async with asyncio.timeout(limits.idle_timeout_s):
                        head = await read_head(reader, limits)
                    if head is None:
                        return
                    connection.answering = True
                    request, http11 = self._request(head, reader, writer)
                except TimeoutError:
                    return  # silent or trickling: closed without a word, as any idle connection
                except HttpError as exc:
                    connection.answering = False  # lingering, it may make room for another
                    await self._refuse(reader, writer, exc)
                    return
                response = await self._answer(request)
                connection_tokens = request.headers.get("connection", "").lower()
                keep_alive = (
                    http11
                    and "close" not in connection_tokens
                    and served < limits.max_requests_per_connection
                    and request.body_read
                    and not self._closing
                )
                async with asyncio.timeout(limits.idle_timeout_s):
                    writer.write(encode(response, head_only=request.method == "HEAD", keep_alive=keep_alive))
                    await writer.drain()
                if not keep_alive:
                    connection.answering = False
                    if not request.body_read:  # a body nobody read is still arriving
                        await self._linger(reader, writer)
                    return
        except (ConnectionError, TimeoutError):
            pass  # the client left, or did not take its answer in time
        except Exception:  # never let one connection take anything else down
            log.exception("debug endpoint connection failed")
        finally:
            connection.answering = False
            writer.close()

    def _request(
        self, head: tuple[str, list[tuple[str, str]]], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[Request, bool]:
        line, fields = head
        method, path, query, http11 = parse_request_line(line)
        headers: dict[str, str] = {}
        for name, value in fields:
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        length = content_length(headers, self.limits.max_body_bytes)
        request = Request(method, path, query, headers, length, reader, writer, self.limits.body_timeout_s)
        return request, http11

    async def _answer(self, request: Request) -> Response:
        methods = self.routes.get(request.path)
        if methods is None:
            return text_response("404: Not Found", 404)
        handler = methods.get(request.method)
        if handler is None and request.method == "HEAD":
            handler = methods.get("GET")
        if handler is None:
            allow = sorted({*methods, *(("HEAD",) if "GET" in methods else ())})
            response = text_response("405: Method Not Allowed", 405)
            return Response(response.status, response.body, response.content_type, (("Allow", ", ".join(allow)),))
        try:
            return await handler(request)
        except ClientGone:
            raise
        except BodyTimeout as exc:
            return text_response(str(exc), 408)
        except Exception:
            log.exception("debug endpoint handler failed", path=request.path, method=request.method)
            return text_response("500: Internal Server Error", 500)

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, error: HttpError) -> None:
        async with asyncio.timeout(self.limits.idle_timeout_s):
            writer.write(encode(text_response(error.message, error.status), keep_alive=False))
            await writer.drain()
        await self._linger(reader, writer)

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Half-close, then read and drop what the client still sends for a moment, so that
        closing does not reset the connection before the client has read the answer (RFC 9112 §9.6)."""
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(self.limits.linger_s):
                while await reader.read(64 * 1024):
                    pass
