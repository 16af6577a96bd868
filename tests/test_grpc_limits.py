"""What a hostile or broken peer on the plugin socket can make the agent do: little, and quickly.

The device plugin servicer is served by :class:`UnixGrpcServer` on a real Unix socket, as in
the agent; grpcio plays a well-formed but greedy client, :mod:`tests.rawgrpc` a rude one.
Hostile-input tests watch the event loop with a lag probe ticking every 10 ms and assert it was
never blocked for more than half a second (each of these inputs used to block it for seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from grpclib import GRPCError
from grpclib.const import Status

from agent.backends.simulated import SimulatedBackend
from agent.base.logs import LogThrottle
from agent.core.config.schema import HealthConfig, PluginConfig
from agent.core.health.model import Signal, SignalKind
from agent.core.health.monitor import HealthMonitor
from agent.core.inventory.model import Inventory
from agent.core.ownership.table import OwnershipState
from agent.deviceplugin.allocate import MAX_CONTAINER_REQUESTS
from agent.deviceplugin.resources import plan_resources
from agent.deviceplugin.service import ResourceService
from agent.deviceplugin.servicer import DevicePluginServicer
from agent.grpc.limits import MAX_STATUS_CHARS, GrpcLimits
from agent.grpc.sockets import UnixGrpcServer
from agent.observe.metrics.agent import LoopLagProbe
from tests._grpcio import deviceplugin_v1beta1_pb2 as pb
from tests._grpcio import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from tests.rawgrpc import RawGrpc, frame, silent_connection
from tests.test_plugin_fakes import FakeCdi, next_message, ownership_for, short_tmpdir, wait_for

pytestmark = pytest.mark.integration

LAG_BOUND_S = 2.0  # the stalls guarded against lasted 3.4 s to 223 s
OK, INVALID_ARGUMENT, DEADLINE_EXCEEDED, UNIMPLEMENTED, RESOURCE_EXHAUSTED = 0, 3, 4, 12, 8


@dataclass
class Served:
    path: Path
    inventory: Inventory
    health: HealthMonitor
    service: ResourceService
    server: UnixGrpcServer
    probe: LoopLagProbe
    rpcs: list[tuple[str, str]] = field(default_factory=list)  # (method, result) as the metrics see them

    def gpu(self, index: int) -> str:
        return self.inventory.gpus[index].uuid

    def channel(self) -> grpc.aio.Channel:
        # a connection of its own per channel (grpcio shares them between channels by default)
        options = [("grpc.max_send_message_length", -1), ("grpc.use_local_subchannel_pool", 1)]
        return grpc.aio.insecure_channel(f"unix://{self.path}", options=options)

    def stub(self, channel: grpc.aio.Channel) -> pb_grpc.DevicePluginStub:
        return pb_grpc.DevicePluginStub(channel)

    def assert_loop_kept_running(self) -> None:
        assert self.probe.max_lag_s < LAG_BOUND_S, f"event loop blocked for {self.probe.max_lag_s:.2f}s"


@contextlib.asynccontextmanager
async def served(limits: GrpcLimits | None = None) -> AsyncIterator[Served]:
    inventory = await SimulatedBackend(preset="h100-8x-nvlink", node_name="n", health=HealthConfig()).load()
    health = HealthMonitor(config=HealthConfig())
    health.set_inventory(inventory)
    config = PluginConfig()
    (resource,) = plan_resources(inventory, config).resources
    service = ResourceService(
        resource=resource,
        config=config,
        inventory=inventory,
        ownership=OwnershipState(ownership_for(inventory)),
        health=health,
        cdi=FakeCdi(),
    )
    rpcs: list[tuple[str, str]] = []
    servicer = DevicePluginServicer(service, observe=lambda method, result, _s: rpcs.append((method, result)))
    probe = LoopLagProbe(interval_s=0.01)
    with short_tmpdir() as root:
        server = UnixGrpcServer(root / "p.sock", [servicer], limits=limits)
        probe_task = asyncio.create_task(probe.run())
        try:
            async with server:
                yield Served(root / "p.sock", inventory, health, service, server, probe, rpcs)
        finally:
            probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe_task


@pytest.fixture
async def s() -> AsyncIterator[Served]:
    async with served() as serving:
        yield serving


async def refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(call, 30)
    return err.value


def allocate(*containers: list[str]) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers])


@contextlib.contextmanager
def grpclib_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """grpclib's own error logging (an 'Application error' traceback) must stay quiet."""
    with caplog.at_level(logging.INFO, logger="grpclib"):
        yield
    noisy = [r for r in caplog.records if r.name.startswith("grpclib") and r.levelno >= logging.ERROR]
    assert not noisy, [r.getMessage() for r in noisy]


# --- size ----------------------------------------------------------------------------------


async def test_a_message_over_4_mib_is_refused_before_its_body_is_read(s: Served) -> None:
    raw = await RawGrpc.connect(s.path)
    try:
        # the prefix announces 50 MB; the body never comes, and is never waited for
        answer = await raw.call("Allocate", frame(b"", length=50_000_000), within_s=5)
    finally:
        await raw.close()
    assert answer.status == RESOURCE_EXHAUSTED
    assert answer.message == "received message larger than max (50000000 vs. 4194304 bytes)"
    assert s.rpcs == [("Allocate", "resource-exhausted")]


async def test_a_5_mib_request_from_grpcio_is_refused(s: Served) -> None:
    async with s.channel() as channel:
        err = await refused(s.stub(channel).Allocate(allocate(["x" * (5 * 1024 * 1024)])))
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    s.assert_loop_kept_running()


async def test_a_megabyte_device_id_is_answered_at_once_and_cut_short(s: Served) -> None:
    """It went uncut into the status message (quadratic HTTP/2 encoding: 223 s) and the log."""
    huge = "GPU-" + "a" * 1_000_000
    with structlog.testing.capture_logs() as logs:
        async with s.channel() as channel:
            err = await refused(s.stub(channel).Allocate(allocate([huge])))
            # and the server still answers
            ok = await s.stub(channel).Allocate(allocate([s.gpu(0)]))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = err.details() or ""
    assert "unknown device IDs" in details and "(1000004 characters)" in details
    assert len(details) < 200
    assert ok.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == s.gpu(0)
    assert all(len(repr(entry)) < 1000 for entry in logs), "an uncut ID reached the log"
    (refusal,) = [e for e in logs if e["event"] == "request refused"]
    assert refusal["device_count"] == 1 and len(refusal["device_ids"][0]) < 100
    s.assert_loop_kept_running()


async def test_status_messages_of_any_handler_are_cut() -> None:
    """A backstop for every service on the helper, whatever its handlers put in an error."""

    class Loud:
        async def shout(self, stream: Any) -> None:
            await stream.recv_message()
            raise GRPCError(Status.INVALID_ARGUMENT, "x" * 100_000)

        def __mapping__(self) -> dict[str, Any]:
            from grpclib.const import Cardinality, Handler

            from agent._proto.deviceplugin import v1beta1 as bpb

            return {
                "/v1beta1.DevicePlugin/Allocate": Handler(
                    self.shout, Cardinality.UNARY_UNARY, bpb.AllocateRequest, bpb.AllocateResponse
                )
            }

    with short_tmpdir() as root:
        async with UnixGrpcServer(root / "l.sock", [Loud()]):
            raw = await RawGrpc.connect(root / "l.sock")
            try:
                answer = await raw.call("Allocate", frame(b""))
            finally:
                await raw.close()
    assert answer.status == INVALID_ARGUMENT
    assert len(answer.message) < MAX_STATUS_CHARS + 50 and answer.message.endswith("(99488 more characters)")


# --- shape: many small things -----------------------------------------------------------------


async def test_20000_container_requests_are_refused_without_blocking_the_loop(s: Served) -> None:
    """20,000 container requests (100 KB) blocked the loop 3.4 s."""
    async with s.channel() as channel:
        err = await refused(s.stub(channel).Allocate(allocate(*([s.gpu(0)] for _ in range(20_000)))))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "AllocateRequest: more than 1024 nested messages in one request"
    assert s.rpcs == [("Allocate", "invalid-argument")]
    s.assert_loop_kept_running()


async def test_more_container_requests_than_the_kubelet_ever_sends_are_refused(s: Served) -> None:
    async with s.channel() as channel:
        stub = s.stub(channel)
        err = await refused(stub.Allocate(allocate(*([s.gpu(0)] for _ in range(MAX_CONTAINER_REQUESTS + 1)))))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == "allocate nvidia.com/gpu: 65 container requests, at most 64 in one call"
        preferred = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(available_deviceIDs=[s.gpu(0)], allocation_size=1)
                for _ in range(MAX_CONTAINER_REQUESTS + 1)
            ]
        )
        err = await refused(stub.GetPreferredAllocation(preferred))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "65 container requests" in (err.details() or "")


async def test_a_device_list_longer_than_the_resource_is_refused_before_any_per_id_work(s: Served) -> None:
    ids = [f"GPU-{i:036d}" for i in range(10_000)]
    async with s.channel() as channel:
        stub = s.stub(channel)
        err = await refused(stub.Allocate(allocate(ids)))
        assert err.details() == "allocate nvidia.com/gpu: 10000 device IDs in one list, but the resource has 8 devices"
        preferred = pb.PreferredAllocationRequest(
            container_requests=[pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=1)]
        )
        err = await refused(stub.GetPreferredAllocation(preferred))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "10000 device IDs" in (err.details() or "")
    s.assert_loop_kept_running()


async def test_a_million_tiny_ids_are_refused_without_decoding_them(s: Served) -> None:
    """3 MB of one-character IDs: 16 s of betterproto decoding, and a million list entries."""
    async with s.channel() as channel:
        err = await refused(s.stub(channel).Allocate(allocate(["x"] * 1_000_000)))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "AllocateRequest: more than 65536 fields in one request"
    s.assert_loop_kept_running()


# --- malformed -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("label", "data", "status", "message"),
    [
        ("garbage", frame(b"\xff\xff\xff\xff"), INVALID_ARGUMENT, "AllocateRequest: malformed protobuf"),
        ("a length past the end", frame(b"\x0a\x7f"), INVALID_ARGUMENT, "AllocateRequest: malformed protobuf"),
        ("a group", frame(b"\x0b\x0c"), INVALID_ARGUMENT, "AllocateRequest: malformed protobuf: wire type 3"),
        ("bad UTF-8 in an ID", frame(b"\x0a\x04\x0a\x02\xc3\x28"), INVALID_ARGUMENT, "cannot decode AllocateRequest"),
        ("truncated body", frame(b"\x0a\x00", length=100), INVALID_ARGUMENT, "truncated request message"),
        ("truncated prefix", b"\x00\x00", INVALID_ARGUMENT, "truncated request message"),
        ("no message at all", b"", INVALID_ARGUMENT, "no request message"),
        ("compressed", frame(b"\x0a\x00", compressed=True), UNIMPLEMENTED, "compressed messages are not supported"),
    ],
)
async def test_malformed_requests_are_invalid_argument_and_counted(
    s: Served, caplog: pytest.LogCaptureFixture, label: str, data: bytes, status: int, message: str
) -> None:
    with grpclib_errors(caplog):
        raw = await RawGrpc.connect(s.path)
        try:
            answer = await raw.call("Allocate", data)
            # the connection stays usable for the next call
            good = await raw.call("GetDevicePluginOptions", frame(b""))
        finally:
            await raw.close()
    assert (answer.status, answer.message[: len(message)]) == (status, message), label
    assert good.status == OK
    expected = {INVALID_ARGUMENT: "invalid-argument", UNIMPLEMENTED: "unimplemented"}[status]
    assert ("Allocate", expected) in s.rpcs, label


# --- time -----------------------------------------------------------------------------------------


async def test_a_half_sent_request_times_out_and_frees_its_call() -> None:
    async with served(GrpcLimits(request_timeout_s=0.3)) as s:
        raw = await RawGrpc.connect(s.path)
        try:
            stream_id = raw.start("Allocate", frame(b"\x0a\x00", length=100), end=False)  # and then nothing
            await wait_for(lambda: s.server._server is not None and s.server._server.gate.calls == 1, what="call")
            answer = await raw.answer(stream_id, within_s=5)
        finally:
            await raw.close()
        assert (answer.status, answer.message) == (DEADLINE_EXCEEDED, "request message not received within 0.3 s")
        assert s.server._server is not None
        await wait_for(lambda: s.server._server is not None and s.server._server.gate.calls == 0, what="call freed")


# --- streams and connections -------------------------------------------------------------------


async def test_list_and_watch_streams_are_capped(s: Served) -> None:
    """2,000 streams took RSS from 54 to 97 MB; the kubelet holds one."""
    limit = s.server.limits.max_streaming_calls
    async with s.channel() as channel:
        stub = s.stub(channel)
        calls = [stub.ListAndWatch(pb.Empty()) for _ in range(limit)]
        for call in calls:
            assert len((await next_message(call)).devices) == 8
        extra = stub.ListAndWatch(pb.Empty())
        err = await refused(extra.read())
        assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.details() == f"more than {limit} concurrent streams"
        # unary calls still go through, and a stream that ends frees its place
        assert (await stub.GetDevicePluginOptions(pb.Empty())).get_preferred_allocation_available
        calls.pop().cancel()
        assert s.server._server is not None
        await wait_for(lambda: s.server._server is not None and s.server._server.gate.streaming < limit, what="free")
        again = stub.ListAndWatch(pb.Empty())
        assert len((await next_message(again)).devices) == 8
        for call in [*calls, again]:
            call.cancel()


async def test_at_the_connection_cap_a_new_client_displaces_the_quietest_silent_one() -> None:
    """1,500 silent connections must not lock the kubelet out of its plugin."""
    async with served(GrpcLimits(max_connections=4)) as s:
        silent = [await silent_connection(s.path) for _ in range(4)]
        try:
            async with s.channel() as channel:
                assert (await s.stub(channel).GetDevicePluginOptions(pb.Empty())).get_preferred_allocation_available
            # the oldest silent connection made room; the others are still open
            await asyncio.wait_for(silent[0][0].read(), 5)  # the server's preface, then EOF
            assert silent[0][0].at_eof()
            assert not any(reader.at_eof() for reader, _ in silent[1:])
            assert s.server._server is not None and len(s.server._server.connections.open) <= 4
        finally:
            for _reader, writer in silent:
                writer.close()


async def test_when_every_connection_is_busy_a_new_one_is_refused() -> None:
    async with served(GrpcLimits(max_connections=2)) as s:
        channels = [s.channel() for _ in range(2)]
        try:
            streams = [s.stub(c).ListAndWatch(pb.Empty()) for c in channels]
            for stream in streams:
                assert len((await next_message(stream)).devices) == 8
            over = RawGrpc(*await silent_connection(s.path))
            assert await over.closed_by_peer(within_s=5)
            await over.close()
            # the busy ones were not touched
            s.health.observe(Signal(uuid=s.gpu(1), kind=SignalKind.INJECTED_FAULT))
            s.service.notify()
            for stream in streams:
                assert {d.ID: d.health for d in (await next_message(stream)).devices}[s.gpu(1)] == "Unhealthy"
                stream.cancel()
        finally:
            for channel in channels:
                await channel.close()


async def test_silent_connections_are_closed_when_idle() -> None:
    async with served(GrpcLimits(idle_timeout_s=0.3)) as s:
        silent = [await silent_connection(s.path) for _ in range(3)]
        try:
            for reader, _writer in silent:
                await asyncio.wait_for(reader.read(), 5)  # the server's preface and GOAWAY, then EOF
                assert reader.at_eof()
            assert s.server._server is not None and not s.server._server.connections.open
        finally:
            for _reader, writer in silent:
                writer.close()


async def test_an_open_list_and_watch_is_never_cut_for_idleness() -> None:
    async with served(GrpcLimits(idle_timeout_s=0.2)) as s, s.channel() as channel:
        stream = s.stub(channel).ListAndWatch(pb.Empty())
        assert len((await next_message(stream)).devices) == 8
        # a silent connection opened now is closed after the idle timeout ...
        reader, writer = await silent_connection(s.path)
        await asyncio.wait_for(reader.read(), 5)
        writer.close()
        # ... while the stream, older than that, still delivers updates
        s.health.observe(Signal(uuid=s.gpu(3), kind=SignalKind.INJECTED_FAULT))
        s.service.notify()
        message = await next_message(stream)
        assert {d.ID: d.health for d in message.devices}[s.gpu(3)] == "Unhealthy"
        stream.cancel()


def test_refusal_logs_are_throttled_with_a_count() -> None:
    now = [100.0]
    throttle = LogThrottle(every_s=10.0, clock=lambda: now[0])
    assert throttle.due() == 1  # the first one is logged
    assert [throttle.due() for _ in range(5)] == [0] * 5  # a flood is folded ...
    now[0] += 10.0
    assert throttle.due() == 6  # ... into the next line, which says how many it stands for


async def test_closing_the_server_closes_every_connection_silent_ones_too() -> None:
    async with served() as s:
        reader, writer = await silent_connection(s.path)
        async with s.channel() as channel:
            assert (await s.stub(channel).GetDevicePluginOptions(pb.Empty())).get_preferred_allocation_available
            await s.server.close()
            await asyncio.wait_for(reader.read(), 5)
            assert reader.at_eof()
        writer.close()


async def test_a_client_that_resets_its_half_sent_request_is_counted_as_aborted(s: Served) -> None:
    raw = await RawGrpc.connect(s.path)
    try:
        stream_id = raw.start("Allocate", frame(b"\x0a\x00", length=100), end=False)
        await wait_for(lambda: s.server._server is not None and s.server._server.gate.calls == 1, what="call")
        with structlog.testing.capture_logs() as logs:
            raw._h2.reset_stream(stream_id)
            raw._flush()
            await wait_for(lambda: s.server._server is not None and s.server._server.gate.calls == 0, what="freed")
    finally:
        await raw.close()
    assert s.rpcs == [("Allocate", "aborted")]
    assert not [e for e in logs if e["log_level"] in ("error", "critical")], logs


async def test_small_requests_are_decoded_once_and_shared_large_and_bad_ones_are_not() -> None:
    from agent._proto.deviceplugin import v1beta1 as bp
    from agent.grpc.limits import SHARED_DECODE_BYTES, CallGate

    gate = CallGate(GrpcLimits(), name="test")
    small = bytes(bp.AllocateRequest(container_requests=[bp.ContainerAllocateRequest(devices_ids=["GPU-0"])]))
    first = await gate._decode("Allocate", small, len(small), bp.AllocateRequest)
    assert await gate._decode("Allocate", small, len(small), bp.AllocateRequest) is first
    assert first.container_requests[0].devices_ids == ["GPU-0"]
    ids = [f"GPU-{i}" for i in range(SHARED_DECODE_BYTES // 6)]
    large = bytes(bp.AllocateRequest(container_requests=[bp.ContainerAllocateRequest(devices_ids=ids)]))
    assert len(large) > SHARED_DECODE_BYTES
    one = await gate._decode("Allocate", large, len(large), bp.AllocateRequest)
    assert await gate._decode("Allocate", large, len(large), bp.AllocateRequest) is not one
    bad = b"\x0a\xff"
    for _ in range(2):  # refused each time, never kept
        with pytest.raises(GRPCError):
            await gate._decode("Allocate", bad, len(bad), bp.AllocateRequest)
