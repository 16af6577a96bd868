"""agent/kube/http.py against real loopback servers: reuse, framing, and every bound held against a hostile server."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from agent.kube.access import ClusterAccess
from agent.kube.client import KubeClient, Limits
from agent.kube.errors import KubeError
from agent.kube.http import (
    HEAD_BYTES,
    MAX_HEADERS,
    BodyTooLarge,
    ConnectTimeout,
    HttpPool,
    HttpProtocolError,
    PoolClosed,
    ServerDisconnected,
    TlsError,
)
from tests.selfsigned import self_signed

Handler = Callable[["Server", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
WITHIN_S = 10.0


async def until(condition: Callable[[], object], what: str) -> None:
    """Wait for ``condition`` (polled), failing after :data:`WITHIN_S`."""
    async with asyncio.timeout(WITHIN_S):
        while not condition():  # noqa: ASYNC110 - the state is spread over the pool, its sockets and the server
            await asyncio.sleep(0.005)
    assert condition(), what


class Server:
    """A loopback server running ``handler`` per connection; counts connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.open = 0
        self.most_open = 0
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.closed_by_client = 0
        self.release = asyncio.Event()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, context: ssl.SSLContext | None = None) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        self.release.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            await self.handler(self, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            self.open -= 1
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes] | None:
        """The next request on the connection, or None when the client closed it."""
        try:
            line = await reader.readuntil(b"\r\n")
        except asyncio.IncompleteReadError:
            self.closed_by_client += 1
            return None
        method, target, _ = line.decode().split(" ", 2)
        headers: dict[str, str] = {}
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        self.requests.append((method, target, headers, body))
        return method, target, headers, body


def answer(body: bytes, *, status: str = "200 OK", extra: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


async def echo(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer each request with its method and target, keep-alive."""
    while request := await server.read_request(reader):
        writer.write(answer(f"{request[0]} {request[1]}".encode()))
        await writer.drain()


@contextlib.asynccontextmanager
async def serving(handler: Handler, **pool_args: object) -> AsyncIterator[tuple[Server, HttpPool]]:
    server = await Server(handler).start()
    pool = HttpPool(server.url, **pool_args)  # type: ignore[arg-type]
    try:
        yield server, pool
    finally:
        await pool.close()
        await server.stop()


async def get(pool: HttpPool, target: str = "/", *, method: str = "GET", limit: int = 1 << 20, **kw: object) -> bytes:
    async with pool.request(method, target, **kw) as response:  # type: ignore[arg-type]
        return await response.read(limit)


# --- reuse and framing ---------------------------------------------------------------------


async def test_keep_alive_connections_are_reused() -> None:
    async with serving(echo) as (server, pool):
        for i in range(3):
            assert await get(pool, f"/api/v1/nodes?n={i}") == f"GET /api/v1/nodes?n={i}".encode()
        assert server.connections == 1 and pool.connects == 1 and pool.idle_connections == 1
        headers = server.requests[0][2]
        assert headers["host"] == f"127.0.0.1:{server.port}" and headers["accept-encoding"] == "identity"
        assert await get(pool, "/x", method="POST") == b"POST /x"
        assert server.requests[-1][2]["content-length"] == "0"


async def test_a_body_is_sent_with_its_length_and_the_path_prefix_is_kept() -> None:
    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while request := await server.read_request(reader):
            writer.write(answer(request[1].encode() + b" " + request[3]))

    server = await Server(handler).start()
    pool = HttpPool(server.url + "/prefix/")
    try:
        assert await get(pool, "/a", method="PUT", body=b'{"x":1}') == b'/prefix/a {"x":1}'
    finally:
        await pool.close()
        await server.stop()


async def test_chunked_bodies_with_extensions_and_trailers() -> None:
    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await server.read_request(reader):
            writer.write(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"5;ext=1\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: t\r\n\r\n"
            )

    async with serving(handler) as (server, pool):
        assert await get(pool) == b"hello world"
        assert await get(pool) == b"hello world"
        assert server.connections == 1  # read to its end: reused


async def test_a_body_that_ends_with_the_connection() -> None:
    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nuntil close")
        await writer.drain()

    async with serving(handler) as (server, pool):
        assert await get(pool) == b"until close"
        assert await get(pool) == b"until close"
        assert server.connections == 2  # not reusable


async def test_interim_answers_are_skipped_and_no_body_statuses_have_none() -> None:
    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await server.read_request(reader):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n")

    async with serving(handler) as (server, pool):
        async with pool.request("DELETE", "/x") as response:
            assert response.status == 204 and await response.read(10) == b""
        assert await get(pool) == b""
        assert server.connections == 1


async def test_a_response_left_unread_closes_its_connection() -> None:
    async with serving(echo) as (server, pool):
        async with pool.request("GET", "/") as response:
            assert response.status == 200
        assert pool.open_connections == 0
        await get(pool)
        assert server.connections == 2


async def test_an_idle_connection_expires_after_keepalive() -> None:
    async with serving(echo, keepalive_s=0.05) as (server, pool):
        await get(pool)
        await until(lambda: pool.open_connections == 0, "the idle connection to expire")
        await until(lambda: server.closed_by_client == 1, "the server to see it closed")


async def test_tls_with_the_callers_context(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl to make a certificate")
    cert, key = self_signed(tmp_path)
    server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ssl.load_cert_chain(cert, key)
    server = await Server(echo).start(server_ssl)
    url = f"https://127.0.0.1:{server.port}"
    trusted = HttpPool(url, ssl_context=ssl.create_default_context(cafile=str(cert)))
    untrusted = HttpPool(url, ssl_context=ssl.create_default_context(cafile=str(cert)), server_hostname="other.name")
    bare = HttpPool(url, ssl_context=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
    try:
        assert await get(trusted) == b"GET /"
        assert await get(trusted) == b"GET /" and trusted.connects == 1
        with pytest.raises(TlsError, match="certificate"):
            await get(bare)
        with pytest.raises(TlsError, match=r"other\.name|match|certificate"):
            await get(untrusted)
        assert bare.open_connections == 0 and untrusted.open_connections == 0
    finally:
        for pool in (trusted, untrusted, bare):
            await pool.close()
        await server.stop()


# --- a server that closes a kept connection ----------------------------------------------------


async def test_a_connection_the_server_closed_while_idle_is_not_reused() -> None:
    async def once(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await server.read_request(reader)
        assert request is not None
        writer.write(answer(b"once"))
        await writer.drain()

    async with serving(once) as (server, pool):
        assert await get(pool) == b"once"
        await until(lambda: pool.idle_connections and not pool._idle[0].usable(), "the client to see the close")
        assert await get(pool, method="POST") == b"once"  # noticed before sending: even a POST is safe
        assert server.connections == 2 and len(server.requests) == 2


async def closes_on_second_request(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer the first request of the first connection, then read the second and close unanswered."""
    first_connection = server.connections == 1
    while await server.read_request(reader):
        if first_connection and len(server.requests) == 2:
            return  # as if its idle timer fired while the request was on its way
        writer.write(answer(b"ok"))
        await writer.drain()


async def test_an_idempotent_request_on_a_connection_closed_under_it_is_sent_again_once() -> None:
    async with serving(closes_on_second_request) as (server, pool):
        assert await get(pool) == b"ok"
        assert await get(pool) == b"ok"
        assert server.connections == 2 and [r[0] for r in server.requests] == ["GET", "GET", "GET"]


async def test_the_retry_goes_on_a_new_connection_not_another_idle_one() -> None:
    in_flight = 0

    async def two_then_close(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal in_flight
        early = server.connections <= 2
        served = 0

        def both_at_the_server() -> bool:
            return in_flight >= 2 or not early

        while await server.read_request(reader):
            if early and served == 1:
                return  # both early connections are closed under the next request
            in_flight += 1
            await until(both_at_the_server, "both early requests at the server")
            writer.write(answer(b"ok"))
            await writer.drain()
            served += 1

    async with serving(two_then_close, max_connections=2) as (server, pool):
        assert list(await asyncio.gather(get(pool), get(pool))) == [b"ok", b"ok"]
        assert pool.idle_connections == 2
        assert await get(pool) == b"ok"  # the most recent idle one is closed under it; the retry opens a third
        assert server.connections == 3 and pool.open_connections == 2


async def test_large_bodies_in_both_framings() -> None:
    big = bytes(range(256)) * 4096  # 1 MiB: past the stream's buffer limit

    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while request := await server.read_request(reader):
            if request[1] == "/chunked":
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big))
            else:
                writer.write(answer(big))
            await writer.drain()

    async with serving(handler) as (server, pool):
        assert await get(pool, "/length", limit=len(big)) == big
        assert await get(pool, "/length", limit=len(big), read_idle_s=WITHIN_S) == big
        assert await get(pool, "/chunked", limit=len(big)) == big
        assert server.connections == 1


async def test_a_post_on_a_connection_closed_under_it_is_not_sent_again() -> None:
    async with serving(closes_on_second_request) as (server, pool):
        assert await get(pool, method="POST") == b"ok"
        with pytest.raises(ServerDisconnected):
            await get(pool, method="POST")
        assert server.connections == 1 and len(server.requests) == 2
        assert pool.open_connections == 0


async def test_a_new_connection_closed_before_an_answer_is_not_retried() -> None:
    async def mute(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)

    async with serving(mute) as (server, pool):
        with pytest.raises(ServerDisconnected):
            await get(pool)
        assert server.connections == 1


# --- hostile servers -------------------------------------------------------------------------


def sends(data: bytes, *, then_wait: bool = False) -> Handler:
    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await server.read_request(reader):
            writer.write(data)
            await writer.drain()
            if then_wait:
                await reader.read()  # until the client closes the connection
                return

    return handler


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"y" * 1000) for i in range(70)) + b"\r\n", "bytes"),
        (b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(MAX_HEADERS + 1)) + b"\r\n", "headers"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * (HEAD_BYTES + 10) + b"\r\n\r\n", "longer than"),
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "status line"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "status line"),
        (b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n", "malformed header"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\nhello", "conflicting"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\nhello", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "Transfer-Encoding"),
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "switched"),
        (b"HTTP/1.1 100 Continue\r\n\r\n" * 6, "interim"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 17 + b"\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * (HEAD_BYTES + 10) + b"\r\n", "longer than"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabX\r\n", "CRLF"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n"
            + b"".join(b"T-%d: y\r\n" % i for i in range(MAX_HEADERS + 1))
            + b"\r\n",
            "trailer",
        ),
    ],
)
async def test_malformed_or_oversized_answers_are_refused(data: bytes, error: str) -> None:
    async with serving(sends(data, then_wait=True)) as (_, pool):
        with pytest.raises(HttpProtocolError, match=error):
            await get(pool, read_idle_s=WITHIN_S)
        assert pool.open_connections == 0


async def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    async with serving(sends(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000000\r\n\r\nxx", then_wait=True)) as (
        _,
        pool,
    ):
        with pytest.raises(BodyTooLarge) as err:
            await get(pool, limit=1000)
        assert err.value.declared == 1_000_000_000_000 and pool.open_connections == 0


@pytest.mark.parametrize("framing", ["chunked", "close"])
async def test_an_undeclared_body_over_the_limit_stops_being_read(framing: str) -> None:
    sent = 0

    async def endless(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await server.read_request(reader)
        chunked = framing == "chunked"
        writer.write(b"HTTP/1.1 200 OK\r\n" + (b"Transfer-Encoding: chunked\r\n" if chunked else b"") + b"\r\n")
        piece = b"x" * 65536
        while not server.release.is_set():
            writer.write(b"10000\r\n" + piece + b"\r\n" if chunked else piece)
            await writer.drain()
            sent += len(piece)

    async with serving(endless) as (_, pool):
        with pytest.raises(BodyTooLarge) as err:
            await get(pool, limit=200_000, read_idle_s=WITHIN_S)
        assert err.value.declared is None and pool.open_connections == 0
    assert sent < 64 * 1024 * 1024  # it stopped reading; the server got rid of the limit plus socket buffers


async def test_a_server_that_never_answers_hits_the_idle_limit() -> None:
    async with serving(sends(b"", then_wait=True)) as (_, pool):
        with pytest.raises(TimeoutError):
            await get(pool, read_idle_s=0.1)
        assert pool.open_connections == 0


async def test_a_server_that_stalls_after_its_headers_hits_the_idle_limit() -> None:
    stalls = sends(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial", then_wait=True)
    async with serving(stalls) as (server, pool):
        async with pool.request("GET", "/", read_idle_s=0.1) as response:
            chunks = response.chunks()
            assert await anext(chunks) == b"partial"
            with pytest.raises(TimeoutError):
                await anext(chunks)
        assert pool.open_connections == 0
        await until(lambda: server.open == 0, "the server to see the connection closed")


async def test_a_server_that_never_completes_the_tls_handshake_hits_the_connect_limit() -> None:
    async def silent(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.release.wait()

    server = await Server(silent).start()
    pool = HttpPool(f"https://127.0.0.1:{server.port}", ssl_context=ssl.create_default_context(), connect_timeout_s=0.1)
    try:
        with pytest.raises(ConnectTimeout):
            await get(pool)
        assert pool.open_connections == 0
    finally:
        await pool.close()
        await server.stop()


async def test_requests_that_could_split_a_header_are_refused() -> None:
    async with serving(echo) as (server, pool):
        with pytest.raises(ValueError, match="line break"):
            await get(pool, headers={"Authorization": "Bearer x\r\nX-Evil: 1"})
        with pytest.raises(ValueError, match="target"):
            await get(pool, "/a b")
        assert server.connections == 0


# --- concurrency and cancellation -----------------------------------------------------------


async def test_max_connections_is_held_under_concurrency() -> None:
    waiting = 0

    async def slow(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal waiting
        while await server.read_request(reader):
            waiting += 1
            await server.release.wait()
            writer.write(answer(b"done"))
            await writer.drain()

    async with serving(slow, max_connections=2) as (server, pool):
        tasks = [asyncio.create_task(get(pool)) for _ in range(6)]
        await until(lambda: waiting == 2, "two requests at the server")
        assert server.connections == 2 and pool.open_connections == 2
        server.release.set()
        assert await asyncio.gather(*tasks) == [b"done"] * 6
        assert server.most_open == 2 and pool.connects == 2


async def test_a_waiter_cancelled_does_not_lose_the_turn() -> None:
    async with serving(echo, max_connections=1) as (server, pool):
        async with pool.request("GET", "/") as first:
            waiter = asyncio.create_task(get(pool))
            other = asyncio.create_task(get(pool))
            await until(lambda: len(pool._waiters) == 2, "two waiters")
            waiter.cancel()
            await first.read(100)
        assert await other == b"GET /"
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert server.connections == 1


async def test_cancellation_mid_body_closes_the_connection() -> None:
    stalls = sends(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n0123456789", then_wait=True)
    async with serving(stalls) as (server, pool):
        got_some = asyncio.Event()

        async def reader() -> None:
            async with pool.request("GET", "/") as response:
                async for _ in response.chunks():
                    got_some.set()

        task = asyncio.create_task(reader())
        async with asyncio.timeout(WITHIN_S):
            await got_some.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pool.open_connections == 0 and pool.idle_connections == 0
        await until(lambda: server.open == 0, "the server to see the connection closed")


async def test_a_closed_pool_refuses_requests() -> None:
    async with serving(echo) as (_, pool):
        await get(pool)
        await pool.close()
        with pytest.raises(PoolClosed):
            await get(pool)


# --- through KubeClient: the messages its callers and metrics read ----------------------------


async def test_the_client_names_a_connect_timeout_and_a_watch_that_never_answers() -> None:
    async def silent(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    server = await Server(silent).start()
    limits = Limits(connect_timeout_s=0.1, watch_idle_s=0.1)
    tls = KubeClient(ClusterAccess(f"https://127.0.0.1:{server.port}", "test", insecure=True), limits=limits)
    plain = KubeClient(ClusterAccess(server.url, "test"), limits=limits)
    try:
        with pytest.raises(KubeError, match=r"could not connect within 0\.1s \(timed out\)") as err:
            await tls.get("/api/v1/nodes/n")
        assert err.value.recoverable and err.value.status is None
        with pytest.raises(KubeError, match=r"^watch http://127\.0\.0\.1:\d+/api/v1/nodes\?.*no answer within 0\.1s"):
            async for _ in plain.watch("/api/v1/nodes", {"labelSelector": "a=b,c!=d"}):
                pass
    finally:
        await tls.close()
        await plain.close()
        await server.stop()
