"""What an HTTP client can make the debug endpoint hold: a few connections, briefly.

Raw TCP clients play the rude ones (silent, half-sent, slow bodies, huge headers), since an
HTTP library would only send well-formed requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from agent.core.health.model import Signal, SignalKind
from agent.core.mechanism import Readiness
from agent.observe.debug.server import DebugContext, HttpLimits, serve_debug

pytestmark = pytest.mark.integration

FAST = HttpLimits(max_connections=4, idle_timeout_s=0.3, body_timeout_s=0.3)


class FakeSim:
    def inject(self, device: str, *, healthy: bool, xid: int | None = None) -> Signal:
        return Signal(uuid="GPU-x", kind=SignalKind.INJECTED_FAULT, xid=xid)


def _context() -> DebugContext:
    return DebugContext(
        state=lambda: {},
        readiness=lambda: {"x": Readiness(True)},
        status=lambda: "serving",
        registry=CollectorRegistry(),
        simulated=FakeSim(),
    )


@contextlib.asynccontextmanager
async def endpoint(limits: HttpLimits = FAST) -> AsyncIterator[int]:
    async with serve_debug(_context(), "127.0.0.1", 0, limits) as port:
        yield port


async def exchange(port: int, data: bytes, *, within_s: float = 5.0) -> bytes:
    """Send ``data`` raw; the server's first response (head and Content-Length body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        async with asyncio.timeout(within_s):
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            return head + await reader.readexactly(length)
    finally:
        writer.close()


async def get(port: int, path: str = "/healthz") -> bytes:
    return await exchange(port, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())


async def closed_by_server(reader: asyncio.StreamReader, within_s: float = 5.0) -> bytes:
    async with asyncio.timeout(within_s):
        return await reader.read()


async def test_at_the_cap_a_probe_displaces_the_quietest_silent_connection() -> None:
    """A flood of silent connections must never make the liveness probe fail."""
    async with endpoint(HttpLimits(max_connections=4, idle_timeout_s=60)) as port:
        silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
        try:
            assert (await get(port)).startswith(b"HTTP/1.1 200 ")
            assert await closed_by_server(silent[0][0]) == b""  # the oldest made room
            assert not any(reader.at_eof() for reader, _ in silent[1:])
        finally:
            for _reader, writer in silent:
                writer.close()


def test_the_oldest_of_equally_quiet_connections_goes_under_uvloop() -> None:
    """The agent runs on uvloop, whose clock moves in milliseconds: silent connections opened in
    one millisecond are equally quiet, and the one admitted first is displaced."""
    uvloop = pytest.importorskip("uvloop")
    for _ in range(5):
        uvloop.run(test_at_the_cap_a_probe_displaces_the_quietest_silent_connection())


async def test_503_only_when_every_connection_is_answering_a_request() -> None:
    async with endpoint(HttpLimits(max_connections=2, body_timeout_s=30)) as port:
        head = b"POST /debug/simulated/health HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
        busy = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        try:
            for _reader, writer in busy:
                writer.write(head + b"{")  # a request in progress, waiting for its body
            await asyncio.sleep(0)
            answer = b""
            async with asyncio.timeout(5):
                while not answer.startswith(b"HTTP/1.1 503 "):  # once both requests are being answered
                    answer = await get(port)
            assert answer.endswith(b"too many open connections")
        finally:
            for _reader, writer in busy:
                writer.close()


async def test_silent_connections_are_closed_after_the_idle_timeout() -> None:
    async with endpoint() as port:
        silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        try:
            for reader, _writer in silent:
                assert await closed_by_server(reader) == b""
        finally:
            for _reader, writer in silent:
                writer.close()


async def test_a_half_sent_request_is_closed_after_the_idle_timeout() -> None:
    async with endpoint() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # the headers never end
            assert await closed_by_server(reader) == b""
        finally:
            writer.close()


async def test_a_body_that_does_not_arrive_is_408() -> None:
    async with endpoint() as port:
        head = b"POST /debug/simulated/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 100\r\n\r\n"
        answer = await exchange(port, head + b'{"device": ')
    assert answer.startswith(b"HTTP/1.1 408 ") and b"request body not received in time" in answer


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        (b"X-Big: " + b"a" * 10_000 + b"\r\n", b"431"),
        (b"".join(b"X-%d: 1\r\n" % i for i in range(40)), b"400"),
    ],
)
async def test_oversized_headers_are_refused(headers: bytes, status: bytes) -> None:
    async with endpoint() as port:
        answer = await exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    assert answer.split(b" ", 2)[1] in (status, b"400"), answer[:200]


async def test_a_large_body_is_413_without_being_read() -> None:
    async with endpoint() as port:
        head = (
            b"POST /debug/simulated/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 50000000\r\n\r\n"
        )
        answer = await exchange(port, head + b"{" * 1000)
    assert answer.startswith(b"HTTP/1.1 413 ")


def test_defaults_are_stated() -> None:
    limits = HttpLimits()
    assert (limits.max_body_bytes, limits.max_connections, limits.idle_timeout_s) == (64 * 1024, 64, 15.0)
