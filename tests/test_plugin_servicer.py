"""The DevicePlugin servicer over grpclib.testing.ChannelFor: translation and status codes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import pytest
import structlog
from grpclib import GRPCError
from grpclib.const import Cardinality, Status
from grpclib.testing import ChannelFor

from agent._proto.deviceplugin import v1beta1 as pb
from agent.backends.simulated import SimulatedBackend
from agent.core.config.schema import HealthConfig, Owner, PluginConfig, TimeSlicingConfig
from agent.core.health.model import Signal, SignalKind
from agent.core.health.monitor import HealthMonitor
from agent.core.inventory.model import Inventory
from agent.core.ownership.table import Drain, OwnershipState
from agent.deviceplugin.resources import plan_resources
from agent.deviceplugin.service import ResourceService
from agent.deviceplugin.servicer import DevicePluginServicer
from tests.test_plugin_fakes import FakeCdi, ownership_for, wait_for


@dataclass
class Env:
    inv: Inventory
    health: HealthMonitor
    ownership: OwnershipState
    service: ResourceService
    servicer: DevicePluginServicer
    stub: pb.DevicePluginStub

    def gpu(self, index: int) -> str:
        found = self.inv.find(str(index))
        assert found is not None
        return found.uuid


async def make_env(config: PluginConfig) -> AsyncIterator[Env]:
    inv = await SimulatedBackend(preset="h100-8x-nvlink", node_name="node-a", health=HealthConfig()).load()
    health = HealthMonitor(config=HealthConfig())
    health.set_inventory(inv)
    ownership = OwnershipState(ownership_for(inv))
    (res,) = plan_resources(inv, config).resources
    service = ResourceService(
        resource=res, config=config, inventory=inv, ownership=ownership, health=health, cdi=FakeCdi()
    )
    servicer = DevicePluginServicer(service)
    async with ChannelFor([servicer]) as channel:
        yield Env(inv, health, ownership, service, servicer, pb.DevicePluginStub(channel))


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    async for e in make_env(PluginConfig()):
        yield e


async def test_options(env: Env) -> None:
    options = await env.stub.get_device_plugin_options(pb.Empty())
    assert options == pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


async def test_allocate_translates(env: Env) -> None:
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[env.gpu(0)])])
    response = await env.stub.allocate(request)
    assert len(response.container_responses) == 1
    assert response.container_responses[0].envs == {"NVIDIA_VISIBLE_DEVICES": env.gpu(0)}


def bad_requests(env: Env) -> list[tuple[str, object, Status]]:
    g0, g1, g2 = env.gpu(0), env.gpu(1), env.gpu(2)

    def alloc(*ids: list[str]) -> pb.AllocateRequest:
        return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=i) for i in ids])

    def pref(avail: list[str], must: list[str], size: int) -> pb.PreferredAllocationRequest:
        return pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_device_i_ds=avail, must_include_device_i_ds=must, allocation_size=size
                )
            ]
        )

    return [
        ("allocate: unknown", alloc(["GPU-unknown"]), Status.INVALID_ARGUMENT),
        ("allocate: unhealthy", alloc([g2]), Status.FAILED_PRECONDITION),
        ("allocate: not owned", alloc([g1]), Status.FAILED_PRECONDITION),
        ("allocate: duplicate", alloc([g0, g0]), Status.INVALID_ARGUMENT),
        ("allocate: empty request", alloc(), Status.INVALID_ARGUMENT),
        ("allocate: empty container", alloc([]), Status.INVALID_ARGUMENT),
        ("prestart: unknown", pb.PreStartContainerRequest(devices_ids=["nope"]), Status.INVALID_ARGUMENT),
        ("prestart: unhealthy", pb.PreStartContainerRequest(devices_ids=[g2]), Status.FAILED_PRECONDITION),
        ("prestart: not owned", pb.PreStartContainerRequest(devices_ids=[g1]), Status.FAILED_PRECONDITION),
        ("prestart: duplicate", pb.PreStartContainerRequest(devices_ids=[g0, g0]), Status.INVALID_ARGUMENT),
        ("prestart: empty", pb.PreStartContainerRequest(devices_ids=[]), Status.INVALID_ARGUMENT),
        ("preferred: size > available", pref([g0, g1], [], 3), Status.INVALID_ARGUMENT),
        ("preferred: must-include outside", pref([g0], [g1], 1), Status.INVALID_ARGUMENT),
        ("preferred: unknown", pref([g0, "x"], [], 1), Status.INVALID_ARGUMENT),
        ("preferred: zero size", pref([g0], [], 0), Status.INVALID_ARGUMENT),
        ("preferred: empty request", pb.PreferredAllocationRequest(), Status.INVALID_ARGUMENT),
    ]


async def test_bad_input_statuses_and_server_keeps_serving(env: Env) -> None:
    env.ownership.update(ownership_for(env.inv, {env.gpu(1): Owner.DRA}, "2"))
    env.health.observe(Signal(uuid=env.gpu(2), kind=SignalKind.INJECTED_FAULT))
    calls = {
        pb.AllocateRequest: env.stub.allocate,
        pb.PreStartContainerRequest: env.stub.pre_start_container,
        pb.PreferredAllocationRequest: env.stub.get_preferred_allocation,
    }
    for label, request, status in bad_requests(env):
        with structlog.testing.capture_logs() as logs, pytest.raises(GRPCError) as err:
            await calls[type(request)](request)  # type: ignore[operator]
        assert err.value.status is status, label
        assert err.value.message, label
        refused = [e for e in logs if e["event"] == "request refused"]
        assert refused and refused[0]["log_level"] == "warning", label
        assert "device_ids" in refused[0], label
    # still serving
    assert (await env.stub.get_device_plugin_options(pb.Empty())).get_preferred_allocation_available


async def test_refusal_log_carries_ids_and_request_context(env: Env) -> None:
    env.ownership.update(ownership_for(env.inv, {env.gpu(1): Owner.DRA}, "2"))
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[env.gpu(1)])])
    with (
        structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs,
        pytest.raises(GRPCError),
    ):
        await env.stub.allocate(request)
    (entry,) = [e for e in logs if e["event"] == "request refused"]
    assert entry["device_ids"] == [env.gpu(1)]
    assert entry["method"] == "Allocate"
    assert entry["resource"] == "nvidia.com/gpu"
    assert entry["status"] == "failed-precondition"
    assert len(entry["request_id"]) == 12


async def test_preferred_allocation_on_nvlink_preset(env: Env) -> None:
    ids = [env.gpu(i) for i in range(8)]
    request = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_device_i_ds=ids, must_include_device_i_ds=[env.gpu(5)], allocation_size=4
            )
        ]
    )
    response = await env.stub.get_preferred_allocation(request)
    (answer,) = response.container_responses
    assert len(answer.device_i_ds) == 4
    assert env.gpu(5) in answer.device_i_ds
    # all pairs have 18 NVLinks: the NUMA-local GPUs (4-7) win
    assert set(answer.device_i_ds) == {env.gpu(i) for i in (4, 5, 6, 7)}


async def test_preferred_allocation_never_prefers_foreign_or_unhealthy_gpus(env: Env) -> None:
    """The kubelet's available list can still hold a GPU handed to DRA or one that just failed:
    the preference skips them, keeps what the kubelet must include, and never errors."""
    env.ownership.update(ownership_for(env.inv, {env.gpu(4): Owner.DRA}, "2"))
    env.health.observe(Signal(uuid=env.gpu(5), kind=SignalKind.INJECTED_FAULT))

    async def prefer(available: list[int], must: list[int], size: int) -> set[str]:
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_device_i_ds=[env.gpu(i) for i in available],
                    must_include_device_i_ds=[env.gpu(i) for i in must],
                    allocation_size=size,
                )
            ]
        )
        (answer,) = (await env.stub.get_preferred_allocation(request)).container_responses
        return set(answer.device_i_ds)

    # GPUs 4 and 5 would be the NUMA-local partners of 6 and 7; the answer takes 6, 7 and two others
    got = await prefer(list(range(8)), [6, 7], 4)
    assert len(got) == 4 and {env.gpu(6), env.gpu(7)} <= got
    assert not got & {env.gpu(4), env.gpu(5)}
    # too few usable candidates: fewer IDs than asked (the kubelet fills the rest itself)
    assert await prefer([4, 5, 6], [], 2) == {env.gpu(6)}
    assert await prefer([4, 5], [], 1) == set()
    # a must-include device stays in the answer: the kubelet already gave it to this container
    assert await prefer([4, 5, 6], [5], 2) == {env.gpu(5), env.gpu(6)}


async def test_preferred_allocation_replicas() -> None:
    config = PluginConfig(time_slicing=TimeSlicingConfig(replicas=2), replica_policy="pack")
    async for env in make_env(config):
        g0, g1 = env.gpu(0), env.gpu(1)
        avail = [f"{g0}::0", f"{g0}::1", f"{g1}::0", f"{g1}::1"]
        request = pb.PreferredAllocationRequest(
            container_requests=[pb.ContainerPreferredAllocationRequest(available_device_i_ds=avail, allocation_size=2)]
        )
        (answer,) = (await env.stub.get_preferred_allocation(request)).container_responses
        assert len({i.split("::")[0] for i in answer.device_i_ds}) == 1  # packed on one GPU


async def test_list_and_watch_first_message_and_topology(env: Env) -> None:
    async with env.stub.channel.request(
        "/v1beta1.DevicePlugin/ListAndWatch",
        Cardinality.UNARY_STREAM,
        pb.Empty,
        pb.ListAndWatchResponse,
    ) as stream:
        await stream.send_message(pb.Empty(), end=True)
        first = await stream.recv_message()
        assert first is not None
        assert [d.id for d in first.devices] == [env.gpu(i) for i in range(8)]
        assert {d.health for d in first.devices} == {"Healthy"}
        assert [d.topology.nodes[0].id for d in first.devices] == [0, 0, 0, 0, 1, 1, 1, 1]
        env.health.observe(Signal(uuid=env.gpu(6), kind=SignalKind.INJECTED_FAULT))
        env.service.notify()
        second = await stream.recv_message()
        assert second is not None
        assert [d.health for d in second.devices][6] == "Unhealthy"
        env.service.stop_streams()
        assert await stream.recv_message() is None  # the stream ends with OK
        await stream.recv_trailing_metadata()
    assert not env.servicer.streams
    assert env.service.changed.subscriber_count == 0


async def test_the_first_answer_waits_until_this_starts_grants_are_decided(env: Env) -> None:
    """Right after a start nothing may be granted yet; an empty first list would tell the kubelet
    "no GPUs here". The first answer waits for the grants (bounded), then carries them."""
    table = env.ownership.current
    env.ownership.current = OwnershipState().current  # nothing granted yet
    env.ownership.decided.clear()
    async with env.stub.channel.request(
        "/v1beta1.DevicePlugin/ListAndWatch", Cardinality.UNARY_STREAM, pb.Empty, pb.ListAndWatchResponse
    ) as stream:
        await stream.send_message(pb.Empty(), end=True)
        await wait_for(lambda: env.servicer.streams, what="the stream open")
        env.ownership.update(table)  # the handover decided
        first = await stream.recv_message()
        assert first is not None and [d.id for d in first.devices] == [env.gpu(i) for i in range(8)]
        env.service.stop_streams()
        await stream.recv_message()
        await stream.recv_trailing_metadata()


async def test_preferred_allocation_keeps_off_gpus_the_plugin_is_giving_up(env: Env) -> None:
    g = [env.gpu(i) for i in range(8)]
    table = env.ownership.current
    closing = {g[0]: Drain(Owner.DEVICE_PLUGIN, Owner.DRA, since=0.0, closing=True)}
    env.ownership.update(replace(table, draining=closing))

    def request(avail: list[str], size: int) -> pb.PreferredAllocationRequest:
        one = pb.ContainerPreferredAllocationRequest(available_device_i_ds=avail, allocation_size=size)
        return pb.PreferredAllocationRequest(container_requests=[one])

    (answer,) = (await env.stub.get_preferred_allocation(request([g[0], g[1]], 1))).container_responses
    assert list(answer.device_i_ds) == [g[1]]
    # only the closing GPU is left: it is still the plugin's to give (a pod bound before the Node changed)
    (answer,) = (await env.stub.get_preferred_allocation(request([g[0], g[1]], 2))).container_responses
    assert sorted(answer.device_i_ds) == sorted([g[0], g[1]])


async def test_per_allocate_line_only_at_debug(env: Env) -> None:
    """At info an Allocate logs nothing (its cost showed); at debug, applied live, it says what went out."""
    import logging

    from agent.base.logs import set_level

    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[env.gpu(0)])])
    root = logging.getLogger()
    before = root.level
    try:
        set_level("info")
        with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
            await env.stub.allocate(request)
        assert [e for e in logs if e["event"] == "allocated"] == []
        set_level("debug")
        with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
            await env.stub.allocate(request)
        (entry,) = [e for e in logs if e["event"] == "allocated"]
        assert entry["device_ids"] == [[env.gpu(0)]]
        assert entry["answers"] == [{"envs": {"NVIDIA_VISIBLE_DEVICES": env.gpu(0)}}]
        assert entry["method"] == "Allocate" and len(entry["request_id"]) == 12
    finally:
        root.setLevel(before)


async def test_repeated_answers_are_equal_and_per_request_keys_stay_per_request() -> None:
    """Answers are kept and shared between equal allocations; a cdi-annotations key never repeats."""
    async for env in make_env(PluginConfig(device_list_strategy=("envvar", "cdi-annotations", "cdi-cri"))):

        def request(*indexes: int, env: Env = env) -> pb.AllocateRequest:
            ids = [env.gpu(i) for i in indexes]
            return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])

        first, again = await env.stub.allocate(request(0)), await env.stub.allocate(request(0))
        (a,), (b,) = first.container_responses, again.container_responses
        assert a.envs == b.envs == {"NVIDIA_VISIBLE_DEVICES": env.gpu(0)}
        assert a.cdi_devices == b.cdi_devices
        assert len(a.annotations) == len(b.annotations) == 1 and a.annotations.keys() != b.annotations.keys()
        (other,) = (await env.stub.allocate(request(0, 3))).container_responses
        assert other.envs == {"NVIDIA_VISIBLE_DEVICES": f"{env.gpu(0)},{env.gpu(3)}"}

    async for env in make_env(PluginConfig(device_list_strategy=("envvar", "cdi-cri"))):
        one = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[env.gpu(0)])])
        first, again = await env.stub.allocate(one), await env.stub.allocate(one)
        assert first == again
        assert [d.name for d in first.container_responses[0].cdi_devices] == [
            f"k8s.gpu-node-agent.nvidia.com/gpu={env.gpu(0)}"
        ]
        assert first.container_responses[0].annotations == {}
