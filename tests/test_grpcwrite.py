"""The coalescing transport: one write per loop turn, in order, nothing lost or delayed past the turn."""

from __future__ import annotations

import asyncio
from typing import Any

from agent.grpc.coalesce import CoalescingTransport


class RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": "peer"}.get(name, default)


async def test_writes_of_one_turn_leave_as_one_in_order() -> None:
    inner = RecordingTransport()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())
    transport.write(b"headers")
    transport.write(bytearray(b"data"))
    transport.writelines([b"trail", memoryview(b"ers")])
    assert inner.writes == []
    assert transport.get_write_buffer_size() == len(b"headersdatatrailers")
    await asyncio.sleep(0)
    assert inner.writes == [b"headersdatatrailers"]
    transport.write(b"next turn")
    await asyncio.sleep(0)
    assert inner.writes == [b"headersdatatrailers", b"next turn"]


async def test_close_writes_what_is_pending_first_and_abort_drops_it() -> None:
    inner = RecordingTransport()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())
    transport.write(b"goaway")
    transport.close()
    assert inner.writes == [b"goaway"] and inner.closed
    await asyncio.sleep(0)  # the scheduled flush finds nothing to write
    assert inner.writes == [b"goaway"]

    inner = RecordingTransport()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())
    transport.write(b"lost")
    transport.abort()
    await asyncio.sleep(0)
    assert inner.writes == [] and inner.aborted


async def test_nothing_is_written_to_a_closing_transport_and_the_rest_is_delegated() -> None:
    inner = RecordingTransport()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())
    transport.write(b"late")
    inner.closed = True  # the peer went away meanwhile
    await asyncio.sleep(0)
    assert inner.writes == []
    assert transport.is_closing()
    assert transport.get_extra_info("peername") == "peer"
