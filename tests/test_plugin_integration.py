"""The device plugin on real Unix sockets, driven by grpcio the way the Go kubelet drives it.

A fake kubelet (grpcio) serves Registration on ``kubelet.sock`` in a temporary kubelet root and
calls GetDevicePluginOptions on the plugin from inside Register. Everything waits on
conditions with timeouts, never on fixed sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest
from structlog.testing import capture_logs

from agent.core.config.schema import Owner, PluginConfig, TimeSlicingConfig
from agent.core.inventory.current import InventoryState
from agent.core.node import NodeFacts
from tests._grpcio import deviceplugin_v1beta1_pb2 as pb
from tests._grpcio import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from tests.test_plugin_fakes import PluginHarness, ids_of, loaded, next_message, plugin_harness, wait_for

pytestmark = pytest.mark.integration

GPU = "nvidia.com/gpu"


@pytest.fixture
async def h() -> AsyncIterator[PluginHarness]:
    async with plugin_harness() as harness:
        await harness.wait_ready()
        yield harness


# --- registration ------------------------------------------------------------------------


async def test_serves_then_registers_like_the_kubelet_expects(h: PluginHarness) -> None:
    (call,) = h.kubelet.calls
    assert call.request.version == "v1beta1"
    assert call.request.endpoint == "gpu-node-agent-nvidia-gpu.sock"  # a basename, relative to device-plugins/
    assert call.request.resource_name == GPU
    assert call.request.options.get_preferred_allocation_available
    assert not call.request.options.pre_start_required
    # the kubelet reached the plugin from inside Register: it served before registering
    assert call.error == ""
    assert call.options is not None and call.options.get_preferred_allocation_available
    state = h.manager.debug_state()
    assert state["ready"] is True
    assert state["watch_mode"] == "inotify"
    resource = state["resources"][GPU]  # type: ignore[index]
    assert resource["registered"] is True and resource["device_count"] == 8
    assert resource["last_register_error"] == ""


async def test_register_failures_are_retried_and_visible() -> None:
    async with plugin_harness(start_kubelet=False) as h:
        await wait_for(lambda: h.manager.servers[GPU].attempts >= 2, what="register retries")
        assert not h.manager.ready
        state = h.manager.debug_state()["resources"][GPU]  # type: ignore[index]
        assert state["registered"] is False
        assert "kubelet.sock" in state["last_register_error"]
        assert h.manager.readiness().detail.startswith("waiting for the kubelet")  # no kubelet is no fault
        await h.kubelet.start()  # kubelet.sock appears (and our socket is wiped): registered once
        await h.settled()
        assert h.kubelet.current is not None and h.kubelet.current.registrations(GPU) == 1
        assert h.manager.debug_state()["resources"][GPU]["last_register_error"] == ""  # type: ignore[index]


async def test_no_kubelet_is_said_once_then_at_debug_and_again_when_it_changes() -> None:
    """With no kubelet, "registration with the kubelet failed" was a warning at every retry:
    every 30 s, for as long as the node had no kubelet."""
    with capture_logs() as logs:
        async with plugin_harness(start_kubelet=False) as h:
            # attempts counts a Register when it starts: wait for four that failed and said so
            await wait_for(
                lambda: sum(e["event"] == "registration with the kubelet failed" for e in logs) >= 4,
                what="four register failures logged",
            )
            h.kubelet.reject = "the ResourceName is invalid"  # a different failure: news
            await h.kubelet.start()
            await wait_for(lambda: "ResourceName is invalid" in h.manager.servers[GPU].last_error, what="rejection")
            h.kubelet.reject = ""
            await h.wait_ready()
    failed = [e for e in logs if e["event"] == "registration with the kubelet failed"]
    said = [e["error"] for e in failed if e["log_level"] == "warning"]
    assert len(said) == 2 and "FileNotFoundError" in said[0] and "ResourceName is invalid" in said[1], said
    assert sum(e["log_level"] == "debug" for e in failed) >= 3
    again = [e["log_level"] for e in logs if e["event"] == "registering with the kubelet again"]
    assert again.count("info") <= 1, again  # a retry after a failure is the failure's own news


async def test_kubelet_rejection_is_retried() -> None:
    async with plugin_harness(start_kubelet=False) as h:
        h.kubelet.reject = "the ResourceName is invalid"
        await h.kubelet.start()
        await wait_for(lambda: len(h.kubelet.calls) >= 2, what="retried Register")
        assert "ResourceName is invalid" in h.manager.servers[GPU].last_error
        h.kubelet.reject = ""
        await h.wait_ready()


# --- ListAndWatch ------------------------------------------------------------------------


async def test_list_and_watch_full_list_with_numa(h: PluginHarness) -> None:
    async with h.channel() as channel:
        call = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty())
        first = await next_message(call)
        assert ids_of(first) == [h.gpu(i) for i in range(8)]
        assert {d.health for d in first.devices} == {"Healthy"}
        assert [[n.ID for n in d.topology.nodes] for d in first.devices] == [[0]] * 4 + [[1]] * 4
        call.cancel()


async def test_health_change_reaches_open_stream(h: PluginHarness) -> None:
    async with h.channel() as channel:
        call = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty())
        await next_message(call)
        h.backend.inject(h.gpu(3), healthy=False, xid=79)
        message = await next_message(call)
        assert {d.ID: d.health for d in message.devices}[h.gpu(3)] == "Unhealthy"
        h.backend.inject(h.gpu(3), healthy=True)
        message = await next_message(call)
        assert {d.health for d in message.devices} == {"Healthy"}
        call.cancel()


async def test_ownership_change_adds_and_removes_devices(h: PluginHarness) -> None:
    async with h.channel() as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        call = stub.ListAndWatch(pb.Empty())
        await next_message(call)
        assert h.set_owner({h.gpu(2): Owner.DRA, "5": Owner.NONE}, "2")
        message = await next_message(call)
        assert ids_of(message) == [h.gpu(i) for i in (0, 1, 3, 4, 6, 7)]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Allocate(
                pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[h.gpu(2)])])
            )
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert h.gpu(2) in (err.value.details() or "")
        assert h.set_owner({}, "3")
        assert ids_of(await next_message(call)) == [h.gpu(i) for i in range(8)]
        call.cancel()


async def test_stream_client_that_goes_away_leaks_nothing(h: PluginHarness) -> None:
    server = h.manager.servers[GPU]
    service = server.service
    assert service is not None
    await h.settled()
    assert server.open_streams == 1  # the kubelet's
    baseline_tasks = len(asyncio.all_tasks())
    for _ in range(5):
        async with h.channel() as channel:
            call = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty())
            await next_message(call)
            assert server.open_streams == 2
        # channel closed without cancelling the call: the connection is gone
        await wait_for(lambda: server.open_streams == 1, what="stream handler gone")
    await wait_for(lambda: service.changed.subscriber_count == 1, what="subscription released")
    await wait_for(lambda: len(asyncio.all_tasks()) <= baseline_tasks, what="no extra tasks")
    assert server.registered and server.service is service  # another client's stream is not the kubelet's


async def test_stream_client_that_never_reads_stays_bounded(h: PluginHarness) -> None:
    server = h.manager.servers[GPU]
    service = server.service
    assert service is not None
    async with h.channel() as channel:
        call = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty())
        await next_message(call)
        for i in range(300):  # a burst of changes nobody reads
            h.set_owner({h.gpu(i % 8): Owner.DRA}, f"burst-{i}")
        await wait_for(lambda: service.changed.subscriber_count == 2, what="ours and the kubelet's")
        for sub in service.changed._subscribers:
            assert sub._queue.qsize() <= 1  # coalesced, never a backlog
        call.cancel()
    await wait_for(lambda: server.open_streams == 1, what="stream handler gone")
    assert service.changed.subscriber_count == 1


# --- Allocate ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "strategies",
    [("envvar",), ("volume-mounts",), ("cdi-annotations",), ("cdi-cri",), ("envvar", "cdi-cri")],
)
async def test_allocate_each_strategy(strategies: tuple[str, ...]) -> None:
    async with plugin_harness(PluginConfig(device_list_strategy=strategies)) as h:  # type: ignore[arg-type]
        await h.wait_ready()
        g0, g1 = h.gpu(0), h.gpu(1)
        async with h.channel() as channel:
            response = await pb_grpc.DevicePluginStub(channel).Allocate(
                pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[g0, g1])])
            )
        (out,) = response.container_responses
        names = [f"{h.cdi.kind}={g0}", f"{h.cdi.kind}={g1}"]
        if "envvar" in strategies:
            assert out.envs["NVIDIA_VISIBLE_DEVICES"] == f"{g0},{g1}"
        if "volume-mounts" in strategies:
            assert out.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
            assert [(m.host_path, m.container_path) for m in out.mounts] == [
                ("/dev/null", f"/var/run/nvidia-container-devices/{g}") for g in (g0, g1)
            ]
        if "cdi-annotations" in strategies:
            ((key, value),) = out.annotations.items()
            assert key.startswith("cdi.k8s.io/gpu-node-agent_")
            assert value.split(",") == names
        if "cdi-cri" in strategies:
            assert [d.name for d in out.cdi_devices] == names
        assert h.cdi.ensured == (1 if any(s.startswith("cdi-") for s in strategies) else 0)
        if not any(s in strategies for s in ("envvar", "volume-mounts")):
            assert "NVIDIA_VISIBLE_DEVICES" not in out.envs


async def test_ownership_change_during_allocate_refuses_the_gpu() -> None:
    """The handover lands while Allocate waits on the CDI spec: the GPU must not be handed out."""
    async with plugin_harness(PluginConfig(device_list_strategy=("cdi-cri",))) as h:
        await h.wait_ready()
        h.cdi.gate = asyncio.Event()
        g0 = h.gpu(0)
        async with h.channel() as channel:
            call = pb_grpc.DevicePluginStub(channel).Allocate(
                pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[g0])])
            )
            pending = asyncio.ensure_future(call)
            await asyncio.wait_for(h.cdi.entered.wait(), 10)
            h.set_owner({g0: Owner.DRA}, "handover")
            h.cdi.gate.set()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pending
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not owned by the device plugin (owner dra)" in (info.value.details() or "")


async def test_time_slicing_replicas_end_to_end() -> None:
    config = PluginConfig(
        time_slicing=TimeSlicingConfig(replicas=3, rename_by_default=True, fail_requests_greater_than_one=True)
    )
    async with plugin_harness(config) as h:
        await h.wait_ready()
        assert [c.request.resource_name for c in h.kubelet.calls] == ["nvidia.com/gpu.shared"]
        async with h.channel("gpu-node-agent-nvidia-gpu.shared.sock") as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            call = stub.ListAndWatch(pb.Empty())
            first = await next_message(call)
            assert len(first.devices) == 24
            g0 = h.gpu(0)
            response = await stub.Allocate(
                pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[f"{g0}::2"])])
            )
            assert response.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == g0
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Allocate(
                    pb.AllocateRequest(
                        container_requests=[pb.ContainerAllocateRequest(devices_ids=[f"{g0}::0", f"{g0}::1"])]
                    )
                )
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            call.cancel()


async def test_bad_inputs_over_the_wire(h: PluginHarness) -> None:
    h.backend.inject(h.gpu(6), healthy=False, xid=79)
    h.set_owner({h.gpu(7): Owner.DRA}, "2")
    g0 = h.gpu(0)

    def alloc(*ids: list[str]) -> pb.AllocateRequest:
        return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=i) for i in ids])

    def pref(avail: list[str], must: list[str], size: int) -> pb.PreferredAllocationRequest:
        request = pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=avail, must_include_deviceIDs=must, allocation_size=size
        )
        return pb.PreferredAllocationRequest(container_requests=[request])

    invalid, precondition = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
    async with h.channel() as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        cases = [
            (stub.Allocate, alloc(["GPU-unknown"]), invalid, "GPU-unknown"),
            (stub.Allocate, alloc([h.gpu(6)]), precondition, h.gpu(6)),
            (stub.Allocate, alloc([h.gpu(7)]), precondition, h.gpu(7)),
            (stub.Allocate, alloc([g0, g0]), invalid, g0),
            (stub.Allocate, alloc([g0], [h.gpu(1), g0]), invalid, "more than one container"),
            (stub.Allocate, alloc(), invalid, "no container requests"),
            (stub.PreStartContainer, pb.PreStartContainerRequest(devices_ids=["nope"]), invalid, "nope"),
            (stub.PreStartContainer, pb.PreStartContainerRequest(devices_ids=[h.gpu(6)]), precondition, h.gpu(6)),
            (stub.GetPreferredAllocation, pref([g0], [], 2), invalid, "exceeds"),
            (stub.GetPreferredAllocation, pref([g0], [h.gpu(1)], 1), invalid, h.gpu(1)),
        ]
        for method, request, code, fragment in cases:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await method(request)  # type: ignore[operator]
            assert err.value.code() is code, fragment
            assert fragment in (err.value.details() or ""), err.value.details()
        await stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=[g0]))  # still serving
        options = await stub.GetDevicePluginOptions(pb.Empty())
        assert options.get_preferred_allocation_available


async def test_preferred_allocation_nvlink_preset(h: PluginHarness) -> None:
    async with h.channel() as channel:
        request = pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=[h.gpu(i) for i in range(8)], must_include_deviceIDs=[h.gpu(1)], allocation_size=2
        )
        response = await pb_grpc.DevicePluginStub(channel).GetPreferredAllocation(
            pb.PreferredAllocationRequest(container_requests=[request])
        )
    (answer,) = response.container_responses
    assert len(answer.deviceIDs) == 2 and h.gpu(1) in answer.deviceIDs
    partner = next(i for i in answer.deviceIDs if i != h.gpu(1))
    assert partner in {h.gpu(i) for i in (0, 2, 3)}  # same NUMA node as GPU 1


# --- restarts ----------------------------------------------------------------------------


async def test_kubelet_restart_leads_to_one_fresh_register(h: PluginHarness) -> None:
    await h.settled()
    first = h.kubelet.current
    assert first is not None
    async with h.channel() as channel:
        call = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty())
        await next_message(call)
        process = await h.kubelet.restart()  # the old kubelet dies, sockets wiped, new kubelet.sock
        await h.settled()
        assert first.registrations(GPU) == 1 and process.registrations(GPU) == 1
        assert process.calls[-1].error == "" and h.socket().is_socket()
        # the run whose socket was wiped was stopped: its streams (ours too) ended with OK
        assert await asyncio.wait_for(call.read(), 5.0) is grpc.aio.EOF
        assert await call.code() is grpc.StatusCode.OK
    assert process.allocatable(GPU) == 8
    async with h.channel() as channel:  # the new socket serves
        call = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty())
        assert len((await next_message(call)).devices) == 8
        call.cancel()


async def test_own_socket_deleted_while_the_kubelet_holds_the_stream(h: PluginHarness) -> None:
    """The kubelet needs the socket file only to dial inside Register: while it holds our stream a
    lost file is no reason to register again (which would race the kubelet's end of that stream).
    When the stream goes, the server restarts on a new file and registers once."""
    await h.settled()
    server = h.manager.servers[GPU]
    h.socket().unlink()
    await wait_for(lambda: h.manager.last_watch_names == {h.socket().name}, what="the watcher saw it")
    await h.settled()
    state = h.manager.debug_state()["resources"][GPU]  # type: ignore[index]
    assert state["socket_present"] is False and state["registered"] is True
    assert server.runs == 1 and h.manager.readiness().ok
    process = h.kubelet.current
    assert process is not None and process.registrations(GPU) == 1

    process.drop(GPU)  # the kubelet ends the stream itself
    await wait_for(lambda: server.runs == 2, what="the restart")
    await h.settled()
    assert h.socket().is_socket() and process.registrations(GPU) == 2
    assert server.last_restart_reason == "own socket deleted or replaced"


async def test_another_clients_stream_is_not_the_kubelets(h: PluginHarness) -> None:
    """A debugging client holding ListAndWatch must not pass for the kubelet: when the kubelet's
    own stream ends, the server registers again although another stream is still open."""
    await h.settled()
    server = h.manager.servers[GPU]
    async with h.channel() as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        await stub.GetDevicePluginOptions(pb.Empty())  # asks what the kubelet asks, outside Register
        call = stub.ListAndWatch(pb.Empty())
        await next_message(call)
        process = h.kubelet.current
        assert process is not None
        process.drop(GPU)
        await wait_for(lambda: process.registrations(GPU) == 2, what="registered again")
        await h.settled()
        assert server.open_streams == 2 and server.runs == 1
        call.cancel()


async def test_kubelet_that_drops_the_stream_gets_one_new_register(h: PluginHarness) -> None:
    await h.settled()
    process = h.kubelet.current
    assert process is not None
    process.drop(GPU)
    await wait_for(lambda: process.registrations(GPU) == 2, what="registered again")
    await h.settled()
    server = h.manager.servers[GPU]
    assert server.runs == 1  # same run, same socket: only Register again
    assert server.last_restart_reason == "the kubelet ended our ListAndWatch stream"
    assert process.dropped_new == 0 and process.registrations(GPU) == 2


async def test_kubelet_sock_touch_does_not_restart(h: PluginHarness) -> None:
    seen: set[str] = set()
    handle = h.manager.on_files_changed

    def record(names: set[str]) -> None:  # the kubelet's checkpoint writes make batches of their own
        seen.update(names)
        handle(names)

    h.manager.on_files_changed = record  # type: ignore[method-assign]
    h.kubelet.socket.chmod(0o600)  # IN_ATTRIB on kubelet.sock, same inode
    h.socket("unrelated.sock").touch()  # seen after the chmod: events are handled in order
    await wait_for(lambda: "unrelated.sock" in seen, what="watch caught up")
    h.socket("unrelated.sock").unlink()
    assert len(h.kubelet.calls) == 1 and h.manager.servers[GPU].runs == 1


async def test_config_change_rebuilds_servers(h: PluginHarness) -> None:
    old_socket = h.socket()
    h.set_plugin_config(PluginConfig(resource_name="example.com/gpu"), "v2")
    await wait_for(lambda: bool(h.kubelet.calls_for("example.com/gpu")), what="new resource registered")
    await h.wait_ready()
    assert not old_socket.exists()
    assert h.socket("gpu-node-agent-example-gpu.sock").is_socket()
    assert list(h.manager.servers) == ["example.com/gpu"]
    # a config change outside the plugin section does not rebuild
    h.config_state.accept(loaded(replace(h.config_state.config, log_level="debug"), "v3"))
    await wait_for(
        lambda: all(s._queue.empty() for s in h.config_state.changes._subscribers), what="config change seen"
    )
    assert len(h.kubelet.calls) == 2
    assert h.manager.servers["example.com/gpu"].runs == 1


async def test_plugin_config_change_that_keeps_the_name_keeps_the_registration(h: PluginHarness) -> None:
    """Stopping the server and registering the same resource again would race the kubelet's
    handling of the old stream's end: the kept server's stream carries the change instead."""
    await h.settled()
    server = h.manager.servers[GPU]
    process = h.kubelet.current
    assert process is not None
    h.set_plugin_config(PluginConfig(device_id_strategy="index", device_list_strategy=("volume-mounts",)), "v2")

    def kubelet_sees_index_ids() -> bool:
        client = process.clients.get(GPU)
        return client is not None and [d.ID for d in client.devices] == [str(i) for i in range(8)]

    await wait_for(kubelet_sees_index_ids, what="the new IDs on the kubelet's stream")
    assert process.registrations(GPU) == 1 and server.runs == 1 and h.manager.servers[GPU] is server
    async with h.channel() as channel:  # the new config answers Allocate too
        response = await pb_grpc.DevicePluginStub(channel).Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["3"])])
        )
    assert [m.container_path for m in response.container_responses[0].mounts] == ["/var/run/nvidia-container-devices/3"]


async def test_plugin_can_be_switched_off_and_on_live(h: PluginHarness) -> None:
    h.set_plugin_config(PluginConfig(enabled=False), "off")
    await wait_for(lambda: not h.manager.servers and not h.socket().exists(), what="every server stopped")
    assert h.manager.ready  # nothing to serve is a ready state
    h.set_plugin_config(PluginConfig(), "on")
    await wait_for(lambda: len(h.kubelet.calls_for(GPU)) == 2, what="registered again")
    await h.wait_ready()
    assert h.socket().is_socket()


async def test_restart_cut_short_by_a_rebuild_leaves_no_old_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rebuild cancels a restart while it drains its streams: the old listener must still close."""
    from agent.deviceplugin.server import RegistrationTimeouts
    from agent.deviceplugin.service import ResourceService

    async with plugin_harness(timeouts=RegistrationTimeouts(stream_drain_s=60.0)) as h:
        await h.settled()
        server = h.manager.servers[GPU]
        run = server._run
        assert run is not None
        listener = run.listener
        async with h.channel() as channel:
            call = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty())
            await next_message(call)
            # streams that ignore the stop: the restart's drain waits for them (60 s here)
            monkeypatch.setattr(ResourceService, "stop_streams", lambda self: None)
            h.socket().unlink()
            process = h.kubelet.current
            assert process is not None
            process.drop(GPU)  # no kubelet stream, no socket: the server restarts
            await wait_for(lambda: server._run is None and listener.serving, what="the restart's drain")
            h.set_plugin_config(PluginConfig(resource_name="example.com/gpu"), "v2")  # lands mid-drain
            await wait_for(lambda: GPU not in h.manager.servers, what="the rebuild")
            await wait_for(lambda: not listener.serving, what="the old listener to close")
            monkeypatch.undo()
            call.cancel()


async def test_exit_removes_sockets() -> None:
    async with plugin_harness() as h:
        await h.wait_ready()
        assert h.socket().is_socket()
        assert h.task is not None
        h.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await h.task
        assert not h.socket().exists()
        assert h.kubelet.socket.exists()  # never touches the kubelet's socket


async def test_nothing_to_serve_is_ready_with_zero_servers() -> None:
    from agent.core.config.current import ConfigState
    from agent.core.config.schema import Config, HealthConfig
    from agent.core.health.monitor import HealthMonitor
    from agent.core.inventory.model import Inventory
    from agent.core.ownership.table import OwnershipState
    from agent.deviceplugin.manager import PluginManager
    from tests.test_plugin_fakes import FakeCdi, short_tmpdir

    with short_tmpdir() as root:
        manager = PluginManager(
            config_state=ConfigState(loaded(Config())),
            node=NodeFacts(
                inventory=InventoryState(Inventory.empty("none")),
                health=HealthMonitor(config=HealthConfig()),
                ownership=OwnershipState(),
            ),
            cdi=FakeCdi(),
            plugin_dir=root / "device-plugins",
        )
        assert not manager.ready  # not before run()
        task = asyncio.create_task(manager.run())
        await wait_for(lambda: manager.ready, what="ready with zero servers")
        assert manager.debug_state()["resources"] == {}
        assert list((root / "device-plugins").iterdir()) == []
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_connection_to_a_stopped_server_is_closed(h: PluginHarness) -> None:
    """A client reusing its connection after a restart must reach the new server, not the old."""
    await h.settled()
    async with h.channel() as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        await stub.GetDevicePluginOptions(pb.Empty())
        await h.kubelet.restart()  # our socket is wiped: the server restarts
        await wait_for(lambda: h.manager.servers[GPU].runs == 2, what="the restart")
        await h.settled()
        call = stub.ListAndWatch(pb.Empty(), wait_for_ready=True)
        assert len((await next_message(call)).devices) == 8
        call.cancel()


async def test_missing_device_plugins_dir_is_waited_for() -> None:
    """No kubelet yet and the directory cannot be made: the manager waits instead of crashing."""
    from agent.backends.simulated import SimulatedBackend
    from agent.core.config.current import ConfigState
    from agent.core.config.schema import Config
    from agent.core.health.monitor import HealthMonitor
    from agent.core.ownership.table import OwnershipState
    from agent.deviceplugin.manager import PluginManager
    from tests.test_plugin_fakes import (
        FAST_BACKOFF,
        FAST_HEALTH,
        NODE,
        PRESET,
        FakeCdi,
        FakeKubelet,
        ownership_for,
        short_tmpdir,
    )

    with short_tmpdir() as root:
        blocker = root / "device-plugins"
        blocker.write_text("not a directory")  # mkdir fails, as it would without permission
        inventory = await SimulatedBackend(preset=PRESET, node_name=NODE, health=FAST_HEALTH).load()
        health = HealthMonitor(config=FAST_HEALTH)
        health.set_inventory(inventory)
        manager = PluginManager(
            config_state=ConfigState(loaded(Config())),
            node=NodeFacts(
                inventory=InventoryState(inventory), health=health, ownership=OwnershipState(ownership_for(inventory))
            ),
            cdi=FakeCdi(),
            plugin_dir=root / "device-plugins",
            backoff=FAST_BACKOFF,
        )
        task = asyncio.create_task(manager.run())
        try:
            await wait_for(lambda: manager.servers and manager.servers[GPU].last_error, what="a failed start")
            assert not task.done() and not manager.ready
            # no kubelet yet, but a server that cannot listen is not "waiting for the kubelet": not ready,
            # and the kubelet socket's directory being unusable is a reason, not a crash
            readiness = manager.readiness()
            assert not readiness.ok and readiness.detail.startswith("device plugin not serving: serve on ")
            assert "\n" not in readiness.detail
            assert manager.debug_state()["kubelet_socket_present"] is None

            blocker.unlink()  # the kubelet starts: it makes the directory and its socket
            kubelet = FakeKubelet(blocker)
            await kubelet.start()
            try:
                await wait_for(lambda: manager.ready, what="registration once the kubelet is there")
                assert kubelet.calls_for(GPU)
            finally:
                await kubelet.stop()
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


async def test_watch_batches_wake_the_servers_they_concern(h: PluginHarness) -> None:
    """Only names that can matter wake a server (each then looks at the state itself); RESCAN
    (the watcher lost track) wakes every one."""
    from agent.base.fswatch import RESCAN

    await h.settled()
    server = h.manager.servers[GPU]
    for names, wakes in [
        ({"unrelated.sock", "kubelet_internal_checkpoint"}, False),
        ({"kubelet.sock"}, True),
        ({h.socket().name}, True),
        ({RESCAN}, True),
    ]:
        server._wake.clear()
        h.manager.on_files_changed(names)
        assert server._wake.is_set() is wakes, names
        await h.settled()
    process = h.kubelet.current
    assert process is not None and process.registrations(GPU) == 1 and server.runs == 1
