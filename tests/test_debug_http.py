"""agent/observe/debug/http.py over real loopback sockets: routes, keep-alive, and every bound.

Raw streams play the hostile clients (an HTTP library only sends well-formed requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator

import pytest

from agent.observe.debug.http import (
    ClientGone,
    HttpLimits,
    HttpServer,
    Request,
    Response,
    Routes,
    json_response,
    text_response,
)

pytestmark = pytest.mark.integration

FAST = HttpLimits(idle_timeout_s=0.5, body_timeout_s=0.5, linger_s=0.5, shutdown_timeout_s=0.5)


class App:
    """Routes of every kind, and what they saw."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.release = asyncio.Event()
        self.entered = asyncio.Event()
        self.gone = asyncio.Event()

    async def ok(self, request: Request) -> Response:
        return text_response("ok\n")

    async def echo(self, request: Request) -> Response:
        try:
            body = await request.read()
        except ClientGone:
            self.gone.set()
            raise
        self.bodies.append(body)
        return json_response({"got": body.decode(), "query": request.query})

    async def boom(self, request: Request) -> Response:
        raise RuntimeError("handler bug")

    async def slow(self, request: Request) -> Response:
        self.entered.set()
        await self.release.wait()
        return text_response("finished")

    def routes(self) -> Routes:
        return {
            "/ok": {"GET": self.ok},
            "/echo": {"POST": self.echo},
            "/boom": {"GET": self.boom},
            "/slow": {"GET": self.slow},
        }


@contextlib.asynccontextmanager
async def serving(app: App, limits: HttpLimits = FAST) -> AsyncIterator[tuple[HttpServer, int]]:
    server = HttpServer(app.routes(), limits, name="test")
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await server.close()


@contextlib.asynccontextmanager
async def connect(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()


async def response(reader: asyncio.StreamReader, *, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
    """One response: status, headers (lower-case names), body by its Content-Length."""
    async with asyncio.timeout(5):
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status_line, *lines = head[:-4].split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        length = 0 if head_only else int(headers["content-length"])
        return int(status_line.split(" ")[1]), headers, await reader.readexactly(length)


async def closed(reader: asyncio.StreamReader) -> bool:
    """True once the server closes the connection (5 s at most)."""
    async with asyncio.timeout(5):
        with contextlib.suppress(ConnectionError):
            while await reader.read(64 * 1024):
                pass
    return True


async def once(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    async with connect(port) as (reader, writer):
        writer.write(data)
        return await response(reader)


def get(path: str, *extra: str) -> bytes:
    return "\r\n".join([f"GET {path} HTTP/1.1", "Host: x", *extra, "", ""]).encode()


def post(path: str, body: bytes, *extra: str) -> bytes:
    return (
        "\r\n".join([f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {len(body)}", *extra, "", ""]).encode()
        + body
    )


async def still_serving(port: int) -> None:
    status, _headers, body = await once(port, get("/ok", "Connection: close"))
    assert (status, body) == (200, b"ok\n")


# --- routes -------------------------------------------------------------------------------------


async def test_get_head_post_404_405() -> None:
    app = App()
    async with serving(app) as (_server, port):
        status, headers, body = await once(port, get("/ok?x=1"))
        assert (status, body) == (200, b"ok\n")
        assert headers["content-type"] == "text/plain; charset=utf-8" and headers["content-length"] == "3"
        assert "date" in headers

        async with connect(port) as (reader, writer):
            writer.write(b"HEAD /ok HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, _ = await response(reader, head_only=True)
            assert (status, headers["content-length"]) == (200, "3")
            writer.write(get("/ok"))  # no body was sent for HEAD: the next answer follows directly
            assert (await response(reader))[2] == b"ok\n"

        status, headers, body = await once(port, post("/echo?q=2", b'{"a": 1}'))
        assert status == 200 and headers["content-type"] == "application/json; charset=utf-8"
        assert json.loads(body) == {"got": '{"a": 1}', "query": "q=2"}

        status, _, body = await once(port, get("/nowhere"))
        assert (status, body) == (404, b"404: Not Found")
        status, headers, body = await once(port, post("/ok", b""))
        assert (status, headers["allow"], body) == (405, "GET, HEAD", b"405: Method Not Allowed")
        status, headers, _ = await once(port, get("/echo"))
        assert (status, headers["allow"]) == (405, "POST")


async def test_absolute_form_and_bare_lf_line_ends() -> None:
    async with serving(App()) as (_server, port):
        assert (await once(port, b"GET http://x/ok HTTP/1.1\r\nHost: x\r\n\r\n"))[0] == 200
        assert (await once(port, b"GET /ok HTTP/1.1\nHost: x\n\n"))[0] == 200
        assert (await once(port, b"\r\n\r\nGET /ok HTTP/1.1\r\n\r\n"))[0] == 200  # RFC 9112 §2.2


async def test_a_handler_that_raises_is_500_and_the_server_keeps_serving() -> None:
    async with serving(App()) as (_server, port), connect(port) as (reader, writer):
        writer.write(get("/boom"))
        status, _, body = await response(reader)
        assert (status, body) == (500, b"500: Internal Server Error")
        writer.write(get("/ok"))  # the same connection still answers
        assert (await response(reader))[0] == 200


async def test_expect_100_continue() -> None:
    async with serving(App()) as (_server, port), connect(port) as (reader, writer):
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
        async with asyncio.timeout(5):
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"{}")
        assert (await response(reader))[0] == 200


# --- keep-alive ---------------------------------------------------------------------------------


async def test_keep_alive_and_pipelining() -> None:
    async with serving(App()) as (_server, port), connect(port) as (reader, writer):
        writer.write(get("/ok") + post("/echo", b"1") + get("/ok"))
        answers = [await response(reader) for _ in range(3)]
        assert [a[0] for a in answers] == [200, 200, 200]
        assert json.loads(answers[1][2])["got"] == "1"
        assert all("connection" not in a[1] for a in answers)


@pytest.mark.parametrize(
    "request_bytes",
    [get("/ok", "Connection: close"), b"GET /ok HTTP/1.0\r\n\r\n", get("/ok", "Connection: keep-alive, Close")],
)
async def test_close_when_asked_and_for_http_1_0(request_bytes: bytes) -> None:
    async with serving(App()) as (_server, port), connect(port) as (reader, writer):
        writer.write(request_bytes)
        _, headers, _ = await response(reader)
        assert headers["connection"] == "close"
        assert await closed(reader)


async def test_requests_per_connection_are_capped() -> None:
    limits = HttpLimits(max_requests_per_connection=3, idle_timeout_s=5)
    async with serving(App(), limits) as (_server, port), connect(port) as (reader, writer):
        writer.write(get("/ok") * 4)
        answers = [await response(reader) for _ in range(3)]
        assert ["connection" in a[1] for a in answers] == [False, False, True]
        assert await closed(reader)  # the fourth request is not answered


async def test_an_idle_keep_alive_connection_is_closed() -> None:
    async with serving(App()) as (_server, port), connect(port) as (reader, writer):
        writer.write(get("/ok"))
        assert (await response(reader))[0] == 200
        assert await closed(reader)  # idle_timeout_s after the answer


async def test_an_unread_body_closes_the_connection_after_the_answer() -> None:
    async with serving(App()) as (_server, port), connect(port) as (reader, writer):
        writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        _, headers, _ = await response(reader)
        assert headers["connection"] == "close"
        assert await closed(reader)


# --- bounds and garbage ---------------------------------------------------------------------------


async def test_slowloris_headers_are_cut_even_while_bytes_keep_coming() -> None:
    """The whole head must arrive within idle_timeout_s; a byte now and then does not extend it."""
    async with serving(App()) as (_server, port), connect(port) as (reader, writer):
        loop = asyncio.get_running_loop()
        start = loop.time()
        writer.write(b"GET /ok HTTP/1.1\r\n")
        with contextlib.suppress(ConnectionError):
            async with asyncio.timeout(5):
                while not reader.at_eof():
                    writer.write(b"X")  # a header that never ends, one byte at a time
                    await writer.drain()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.05):  # pacing of the attack, not a wait for the server
                            await reader.read(1)
        assert reader.at_eof() or writer.is_closing()
        assert loop.time() - start < 3


@pytest.mark.parametrize(
    ("data", "status", "words"),
    [
        (b"GET /" + b"a" * (1 << 20) + b" HTTP/1.1\r\n\r\n", 414, b"request line too long"),
        (b"GET /" + b"a" * (1 << 20), 414, b"request line too long"),  # no line end at all
        (get("/ok", "X-Big: " + "a" * 9000), 431, b"header field too long"),
        (get("/ok", *(f"X-{i}: " + "a" * 6000 for i in range(3))), 431, b"request header fields too large"),
        (get("/ok", *(f"X-{i}: 1" for i in range(33))), 400, b"too many header fields"),
        (get("/ok", "NoColonHere"), 400, b"header field without a colon"),
        (get("/ok", "Name : value"), 400, b"invalid header field name"),
        (get("/ok", "X-A: 1", " folded"), 400, b"obsolete line folding"),
        (get("/ok", "X-A: a\x00b"), 400, b"invalid header field value"),
        (get("/ok", "X-A: a\rb"), 400, b"invalid header field value"),
        (b"GET /ok\r\n\r\n", 400, b"malformed request line"),
        (b"GET  /ok HTTP/1.1\r\n\r\n", 400, b"malformed request line"),
        (b"G(T /ok HTTP/1.1\r\n\r\n", 400, b"invalid method"),
        (b"GET ok HTTP/1.1\r\n\r\n", 400, b"invalid request target"),
        (b"GET /\xff HTTP/1.1\r\n\r\n", 400, b"invalid request target"),
        (b"GET /ok HTTP/2.0\r\n\r\n", 505, b"only HTTP/1.0 and HTTP/1.1"),
        (b"GET /ok SPDY/3\r\n\r\n", 400, b"malformed request line"),
        (post("/echo", b"", "Content-Length: -5"), 400, b"conflicting Content-Length"),
        (b"POST /echo HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 400, b"invalid Content-Length"),
        (b"POST /echo HTTP/1.1\r\nContent-Length: 1e3\r\n\r\n", 400, b"invalid Content-Length"),
        (b"POST /echo HTTP/1.1\r\nContent-Length: \xd9\xa3\r\n\r\n", 400, b"invalid Content-Length"),
        (b"POST /echo HTTP/1.1\r\nContent-Length: " + b"9" * 100_000 + b"\r\n\r\n", 431, b"too long"),
        (b"POST /echo HTTP/1.1\r\nContent-Length: " + b"9" * 30 + b"\r\n\r\n", 413, b"over the limit"),
        (b"POST /echo HTTP/1.1\r\nContent-Length: 65537\r\n\r\n{", 413, b"over the limit of 65536 bytes"),
        (b"POST /echo HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400, b"conflicting"),
        (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 411, b"Content-Length"),
        (
            b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n{}",
            400,
            b"both Transfer-Encoding and Content-Length",
        ),
    ],
)
async def test_bad_requests_get_one_line_and_a_closed_connection(data: bytes, status: int, words: bytes) -> None:
    app = App()
    async with serving(app) as (_server, port), connect(port) as (reader, writer):
        writer.write(data)
        got, headers, body = await response(reader)
        assert (got, headers["connection"]) == (status, "close"), body
        assert words in body and b"\n" not in body
        assert await closed(reader)
        assert app.bodies == []
        await still_serving(port)


async def test_a_body_that_never_arrives_is_408() -> None:
    async with serving(App()) as (_server, port):
        status, _, body = await once(port, b"POST /echo HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
    assert (status, body) == (408, b"request body not received in time")


async def test_a_client_that_leaves_mid_body_is_forgotten() -> None:
    app = App()
    async with serving(app) as (_server, port):
        async with connect(port) as (_reader, writer):
            writer.write(b'POST /echo HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"half')
            await writer.drain()
        async with asyncio.timeout(5):
            await app.gone.wait()
        assert app.bodies == []
        await still_serving(port)


@pytest.mark.parametrize("seed", range(20))
async def test_random_bytes_never_crash_the_server(seed: int) -> None:
    rng = random.Random(seed)
    garbage = rng.randbytes(rng.randrange(1, 40_000))
    if seed % 2:
        garbage += b"\r\n\r\n"
    async with serving(App()) as (_server, port):
        async with connect(port) as (reader, writer):
            writer.write(garbage)
            with contextlib.suppress(ConnectionError):
                async with asyncio.timeout(5):
                    answer = await reader.read()  # an error answer, or a close at the idle timeout
            assert answer == b"" or answer.startswith(b"HTTP/1.1 4"), answer[:100]
        await still_serving(port)


# --- the connection cap and shutdown ---------------------------------------------------------------


async def test_the_connection_cap_refuses_with_503_when_all_are_busy() -> None:
    app = App()
    limits = HttpLimits(max_connections=1, idle_timeout_s=5)
    async with serving(app, limits) as (_server, port), connect(port) as (reader, writer):
        writer.write(get("/slow"))
        async with asyncio.timeout(5):
            await app.entered.wait()
        status, headers, body = await once(port, get("/ok"))
        assert (status, headers["connection"], body) == (503, "close", b"too many open connections")
        app.release.set()
        assert (await response(reader))[2] == b"finished"


async def test_shutdown_finishes_answers_closes_idle_connections_and_leaves_no_task() -> None:
    app = App()
    async with contextlib.AsyncExitStack() as stack:
        server = HttpServer(app.routes(), HttpLimits(idle_timeout_s=60, shutdown_timeout_s=5), name="shut")
        port = await server.start("127.0.0.1", 0)
        idle_reader, _ = await stack.enter_async_context(connect(port))
        busy_reader, busy_writer = await stack.enter_async_context(connect(port))
        busy_writer.write(get("/slow"))
        async with asyncio.timeout(5):
            await app.entered.wait()
        closing = asyncio.create_task(server.close())
        assert await closed(idle_reader)
        app.release.set()
        status, headers, body = await response(busy_reader)
        assert (status, body, headers["connection"]) == (200, b"finished", "close")
        async with asyncio.timeout(5):
            await closing
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("shut-http-")]
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_shutdown_cuts_an_answer_that_does_not_finish() -> None:
    app = App()
    server = HttpServer(app.routes(), HttpLimits(shutdown_timeout_s=0.2), name="cut")
    port = await server.start("127.0.0.1", 0)
    async with connect(port) as (reader, writer):
        writer.write(get("/slow"))
        async with asyncio.timeout(5):
            await app.entered.wait()
            await server.close()
        assert await closed(reader)
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("cut-http-")]


def test_limits_keep_or_tighten_the_documented_bounds() -> None:
    limits = HttpLimits()
    assert (limits.max_line_bytes, limits.max_header_bytes, limits.max_headers) == (8190, 8190, 32)
    assert (limits.max_head_bytes, limits.max_requests_per_connection) == (16 * 1024, 100)
    assert (limits.linger_s, limits.shutdown_timeout_s, limits.body_timeout_s) == (1.0, 1.0, 5.0)


def test_the_503_reaches_the_client_under_uvloop() -> None:
    """The agent runs on uvloop, whose transports are not ``asyncio.WriteTransport``: the refusal
    was checked against that class and silently dropped there (the client saw a bare close)."""
    uvloop = pytest.importorskip("uvloop")
    uvloop.run(test_the_connection_cap_refuses_with_503_when_all_are_busy())
