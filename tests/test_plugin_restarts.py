"""Registration survives every kubelet restart: hundreds of them, in every pattern, counted by the kubelet.

The agent's device plugin (in process, real Unix sockets) against the rude fake kubelet of
:mod:`tests.fake_kubelet`. A synchronous ``restart_now`` on the event loop thread is a kubelet
restart while the agent is paused (it runs nothing until the call returns); ``await restart()``
runs one in a worker thread while the agent keeps running. After every pattern the kubelet's own
counts must say: at most one registration per kubelet start, exactly one for every start the
agent had time to see, no new connection dropped by a racing registration, and the running
kubelet holds a live ListAndWatch stream with every device allocatable.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from agent.deviceplugin.server import RegistrationTimeouts
from tests._grpcio import deviceplugin_v1beta1_pb2 as pb
from tests._grpcio import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from tests.fake_kubelet import FakeKubelet, KubeletProcess
from tests.test_plugin_fakes import PluginHarness, plugin_harness, short_tmpdir, wait_for

pytestmark = pytest.mark.integration

GPU = "nvidia.com/gpu"
ROUNDS = 25  # per single-restart pattern: 6 patterns, 2 bursts of 50 and 5 more = 255 restarts here
BURST = 50


#: a short settle keeps hundreds of restarts fast, and shows that correctness never rests on
#: events coalescing: the agent may well act on half a restart and must still register once
FAST = RegistrationTimeouts(settle_s=0.005, settle_max_s=0.2)


@pytest.fixture
async def h() -> AsyncIterator[PluginHarness]:
    async with plugin_harness(timeouts=FAST) as harness:
        await harness.settled()
        yield harness


def check_starts(h: PluginHarness, starts: list[KubeletProcess], *, every_start_seen: bool) -> None:
    """The kubelet-side verdict on ``starts`` (the latest is the running kubelet)."""
    counts = [p.registrations(GPU) for p in starts]
    if every_start_seen:
        assert counts == [1] * len(counts), counts
    else:
        assert max(counts) <= 1 and counts[-1] == 1, counts
    assert [p.dropped_new for p in starts] == [0] * len(starts)
    assert h.kubelet.holds_live_stream(GPU)
    assert starts[-1].allocatable(GPU) == 8
    assert h.manager.readiness().ok and h.manager.servers[GPU].registered


def inodes_recycled() -> bool:
    """Whether this file system hands a freed inode number to the next file (ext4 does, tmpfs not)."""
    with short_tmpdir() as root:
        fd = os.open(root / "a", os.O_CREAT | os.O_WRONLY)
        first = os.fstat(fd).st_ino
        os.close(fd)
        os.unlink(root / "a")
        fd = os.open(root / "b", os.O_CREAT | os.O_WRONLY)
        second = os.fstat(fd).st_ino
        os.close(fd)
    return first == second


# --- one restart at a time ---------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern",
    ["paused", "concurrent", "swapped-paused", "swapped-concurrent", "inode-reuse-paused", "inode-reuse-concurrent"],
)
async def test_every_kubelet_start_gets_exactly_one_registration(h: PluginHarness, pattern: str) -> None:
    """paused: the agent runs nothing while the kubelet dies, wipes the directory and listens
    again, then sees everything at once (SIGSTOP-like). concurrent: the agent runs meanwhile and
    may see the stream end, the wipe and the new kubelet.sock one by one. swapped: kubelet.sock
    is created before the other files are wiped. inode-reuse: the new kubelet.sock gets the old
    one's inode number."""
    order = "socket-first" if pattern.startswith("swapped") else "wipe-first"
    reuse = pattern.startswith("inode-reuse")
    first = len(h.kubelet.starts)
    for _ in range(ROUNDS):
        if pattern.endswith("paused"):
            h.kubelet.restart_now(order=order, reuse_inode=reuse)
        else:
            await h.kubelet.restart(order=order, reuse_inode=reuse)
        await h.settled()
        current = h.kubelet.current
        assert current is not None and current.registrations(GPU) == 1
    check_starts(h, h.kubelet.starts[first:], every_start_seen=True)
    if reuse and inodes_recycled():
        # the pattern really happened: the new kubelet.sock had the old inode number (all of the
        # time on a quiet ext4; other processes creating files at the same moment can take it)
        print(f"inode reused in {h.kubelet.inode_reuses} of {ROUNDS} restarts")
        assert h.kubelet.inode_reuses >= ROUNDS // 5, h.kubelet.inode_reuses


# --- bursts --------------------------------------------------------------------------------


async def test_a_burst_while_paused_ends_in_one_registration(h: PluginHarness) -> None:
    first = len(h.kubelet.starts)
    for i in range(BURST):  # 50 kubelet starts the paused agent never sees but the last
        h.kubelet.restart_now(reuse_inode=i % 2 == 0, order="wipe-first" if i % 3 else "socket-first")
    await h.settled()
    starts = h.kubelet.starts[first:]
    assert [p.registrations(GPU) for p in starts] == [0] * (BURST - 1) + [1]
    check_starts(h, starts, every_start_seen=False)


async def test_a_burst_of_back_to_back_restarts_never_registers_twice(h: PluginHarness) -> None:
    """The agent runs meanwhile and may register with any of the kubelets: never twice with one."""
    first = len(h.kubelet.starts)
    for i in range(BURST):
        await h.kubelet.restart(reuse_inode=i % 2 == 0, order="wipe-first" if i % 3 else "socket-first")
    await h.settled()
    check_starts(h, h.kubelet.starts[first:], every_start_seen=False)


# --- a kubelet that takes its time, or misbehaves ----------------------------------------------


async def test_kubelet_down_then_back_is_not_ready_then_registered_once(h: PluginHarness) -> None:
    """A crashed kubelet leaves its kubelet.sock, which refuses connections until the new kubelet
    starts: meanwhile /readyz says not registered; the new kubelet gets one registration."""
    server = h.manager.servers[GPU]

    async def while_down() -> None:
        await wait_for(lambda: "Register with" in server.last_error, what="a refused Register")
        readiness = h.manager.readiness()
        assert not readiness.ok and readiness.detail.startswith("device plugin not registered: Register with")
        assert h.manager.debug_state()["resources"][GPU]["registered"] is False  # type: ignore[index]

    first = len(h.kubelet.starts)
    for _ in range(5):
        await h.kubelet.restart(crash=True, between=while_down)
        await h.settled()
    check_starts(h, h.kubelet.starts[first:], every_start_seen=True)


async def test_kubelet_that_never_opens_the_stream_is_asked_again() -> None:
    async with plugin_harness(timeouts=RegistrationTimeouts(stream_open_s=0.1, settle_s=0.005)) as h:
        await h.settled()
        h.kubelet.open_streams = False  # accepts Register, never calls ListAndWatch
        h.kubelet.restart_now()
        process = h.kubelet.current
        assert process is not None
        await wait_for(lambda: process.registrations(GPU) >= 3, what="registered again, and again")
        server = h.manager.servers[GPU]
        assert not h.manager.ready and server.last_restart_reason.startswith("the kubelet opened no ListAndWatch")
        h.kubelet.open_streams = True
        await h.settled()
        assert process.dropped_new == 0
        assert server.runs == 2  # one restart for the wiped socket; then Register again on that run


async def test_socket_wiped_while_the_kubelet_dials_it_inside_register(h: PluginHarness) -> None:
    """A kubelet that wipes the directory just after our Register reached it dials a missing
    path and waits (WithBlock). The run listens there again, so that very dial registers it:
    no second run, no second Register, no ten-second stall."""
    server = h.manager.servers[GPU]
    socket = h.socket()

    def wipe_once() -> None:
        h.kubelet.before_dial = None
        socket.unlink()

    h.kubelet.restart_now()
    h.kubelet.before_dial = wipe_once  # the new run's Register meets a wipe
    await h.settled()
    process = h.kubelet.current
    assert process is not None and process.registrations(GPU) == 1 and process.dropped_new == 0
    assert server.runs == 2  # the restart's run, not a third one
    run = server._run
    assert run is not None and len(run.retired) == 1 and socket.is_socket()


async def test_debug_state_tells_the_registration_story(h: PluginHarness) -> None:
    state = h.manager.debug_state()["resources"][GPU]  # type: ignore[index]
    assert state["registered"] is True and state["socket_present"] is True
    assert state["registered_since"] and state["stream_open_since"]
    assert state["registrations"] == 1 and state["last_restart_reason"] == ""
    await h.kubelet.restart()
    await h.settled()
    state = h.manager.debug_state()["resources"][GPU]  # type: ignore[index]
    assert state["registrations"] == 2 and state["runs"] == 2
    assert state["last_restart_reason"] in (
        "own socket deleted or replaced",  # saw the wipe first
        "the kubelet ended our ListAndWatch stream",  # saw the stream end first, then the wipe
    )


# --- the fake itself is as rude as the real kubelet ---------------------------------------


class NaivePlugin(pb_grpc.DevicePluginServicer):
    """A plugin that restarts the textbook way (end streams, serve again, Register at once)."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()

    async def GetDevicePluginOptions(self, request: pb.Empty, context: object) -> pb.DevicePluginOptions:  # type: ignore[override]
        return pb.DevicePluginOptions()

    async def ListAndWatch(self, request: pb.Empty, context: object) -> AsyncIterator[pb.ListAndWatchResponse]:  # type: ignore[override]
        yield pb.ListAndWatchResponse(devices=[pb.Device(ID="d0", health="Healthy")])
        await self.stop.wait()


@contextlib.asynccontextmanager
async def naive_run(path: Path) -> AsyncIterator[NaivePlugin]:
    plugin = NaivePlugin()
    server = grpc.aio.server()
    pb_grpc.add_DevicePluginServicer_to_server(plugin, server)
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    try:
        yield plugin
    finally:
        plugin.stop.set()  # the stream ends with OK
        await server.stop(grace=1)


async def register(kubelet: FakeKubelet, endpoint: str) -> None:
    async with grpc.aio.insecure_channel(f"unix:{kubelet.socket}") as channel:
        request = pb.RegisterRequest(version="v1beta1", endpoint=endpoint, resource_name="example.com/naive")
        await pb_grpc.RegistrationStub(channel).Register(request)


@pytest.mark.parametrize("wait_for_the_kubelet", [False, True])
async def test_the_fake_kubelet_drops_a_registration_that_races_the_old_stream(wait_for_the_kubelet: bool) -> None:
    """The race of reference §13: a second Register before the kubelet has handled the end of
    the first stream loses the new connection; after it has, the second registration holds."""
    resource = "example.com/naive"
    with short_tmpdir() as root:
        kubelet = FakeKubelet(root / "device-plugins", stream_end_delay_s=0.05)
        process = await kubelet.start()
        path = kubelet.plugin_dir / "naive.sock"
        try:
            async with naive_run(path):
                await register(kubelet, path.name)
                await wait_for(lambda: process.holds_live_stream(resource), what="the first stream")
            if wait_for_the_kubelet:
                await wait_for(lambda: resource in process.disconnected, what="the kubelet to see the end")
            async with naive_run(path):
                await register(kubelet, path.name)
                if wait_for_the_kubelet:
                    await wait_for(lambda: process.holds_live_stream(resource), what="the second stream")
                    assert process.dropped_new == 0
                else:
                    await wait_for(lambda: process.dropped_new == 1, what="the new connection dropped")
                    assert not process.holds_live_stream(resource) and process.allocatable(resource) == 0
            assert process.registrations(resource) == 2
        finally:
            await kubelet.stop()
