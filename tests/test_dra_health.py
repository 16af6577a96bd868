"""The DRA resource health stream (v1alpha1.DRAResourceHealth) as the kubelet reads it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from agent.core.config.schema import Owner
from agent.dra.mechanism import DraTuning
from tests._grpcio import drahealth_v1alpha1_pb2 as pb
from tests.dra_fakes import FAST, NODE, DraHarness, dra_harness

pytestmark = pytest.mark.integration


class ManualClock:
    """The health feed's ``sleep``: returns only when the test says the period has passed."""

    def __init__(self) -> None:
        self.waiting = 0
        self._tick = asyncio.Condition()
        self.periods: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.periods.append(seconds)
        async with self._tick:
            self.waiting += 1
            try:
                await self._tick.wait()
            finally:
                self.waiting -= 1

    async def tick(self) -> None:
        async with self._tick:
            self._tick.notify_all()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def h(clock: ManualClock) -> AsyncIterator[DraHarness]:
    tuning = DraTuning(timeouts=FAST.timeouts, backoff=FAST.backoff, health_sleep=clock.sleep)
    async with dra_harness(tuning=tuning) as harness:
        yield harness


async def next_message(call: Any, within_s: float = 2.0) -> pb.NodeWatchResourcesResponse:
    message = await asyncio.wait_for(call.read(), within_s)
    assert message is not grpc.aio.EOF, "stream ended"
    return message  # type: ignore[no-any-return]


def health_of(message: pb.NodeWatchResourcesResponse) -> dict[str, int]:
    return {d.device.device_name: d.health for d in message.devices}


async def test_first_message_is_the_complete_list(h: DraHarness) -> None:
    h.set_owner({"7": Owner.DEVICE_PLUGIN}, "2")
    async with h.channel() as channel:
        call = h.health_stub(channel).NodeWatchResources(pb.NodeWatchResourcesRequest())
        first = await next_message(call)
        assert health_of(first) == {f"gpu-{i}": pb.HEALTHY for i in range(7)}  # gpu-7 is not DRA's
        device = first.devices[0]
        assert device.device.pool_name == NODE
        assert device.health_check_timeout_seconds == 45 and device.last_updated_time > 1_700_000_000
        assert device.message == ""
        call.cancel()


async def test_a_health_change_sends_a_new_complete_message(h: DraHarness) -> None:
    async with h.channel() as channel:
        call = h.health_stub(channel).NodeWatchResources(pb.NodeWatchResourcesRequest())
        await next_message(call)
        h.fault(h.gpu(3))
        message = await next_message(call)
        assert len(message.devices) == 8
        sick = next(d for d in message.devices if d.device.device_name == "gpu-3")
        assert sick.health == pb.UNHEALTHY and sick.message
        h.fault(h.gpu(3), healthy=True)
        assert set(health_of(await next_message(call)).values()) == {pb.HEALTHY}
        h.set_owner({"0": Owner.NONE}, "3")  # the device list changes: gpu-0 leaves
        assert "gpu-0" not in health_of(await next_message(call))
        call.cancel()


async def test_the_list_is_resent_every_period_without_changes(h: DraHarness, clock: ManualClock) -> None:
    async with h.channel() as channel:
        call = h.health_stub(channel).NodeWatchResources(pb.NodeWatchResourcesRequest())
        first = await next_message(call)
        await asyncio.wait_for(_until(lambda: clock.waiting == 1), 2)
        assert clock.periods[-1] == 10.0 < first.devices[0].health_check_timeout_seconds / 3
        for _ in range(2):
            await clock.tick()
            again = await next_message(call)
            assert health_of(again) == health_of(first)
            await asyncio.wait_for(_until(lambda: clock.waiting == 1), 2)
        call.cancel()
    assert h.m.debug_state()["health"]["messages_sent"] == 3  # type: ignore[index]


async def test_streams_are_bounded(h: DraHarness) -> None:
    async with h.channel() as channel:
        stub = h.health_stub(channel)
        calls = [stub.NodeWatchResources(pb.NodeWatchResourcesRequest()) for _ in range(4)]
        for call in calls:
            await next_message(call)
        extra = stub.NodeWatchResources(pb.NodeWatchResourcesRequest())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await extra.read()
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert h.metric("gpu_agent_dra_health_streams") == 4.0
        for call in calls:
            call.cancel()
    await asyncio.wait_for(_until(lambda: h.m.feed.streams == 0), 2)


async def _until(condition: Any) -> None:
    while not condition():  # noqa: ASYNC110
        await asyncio.sleep(0.005)
