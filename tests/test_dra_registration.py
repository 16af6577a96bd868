"""The DRA plugin's sockets and registration, driven by grpcio the way the kubelet drives them."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from agent.core.config.schema import Owner
from agent.dra.kubelet.endpoints import KubeletPlugin
from agent.dra.kubelet.registration import RegistrationState
from agent.dra.kubelet.registration_servicer import RegistrationServicer
from agent.dra.metrics import DraMetrics
from tests._grpcio import dra_v1_pb2, dra_v1_pb2_grpc
from tests.dra_fakes import DRIVER, DraHarness, dra_harness, make_config
from tests.test_plugin_fakes import FAST_BACKOFF, short_tmpdir, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
async def h() -> AsyncIterator[DraHarness]:
    async with dra_harness() as harness:
        yield harness


async def prepare_answers(path: Path) -> bool:
    async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
        response = await dra_v1_pb2_grpc.DRAPluginStub(channel).NodePrepareResources(
            dra_v1_pb2.NodePrepareResourcesRequest(), timeout=1.0
        )
    return dict(response.claims) == {}


async def test_get_info_answers_what_the_kubelet_validates(h: DraHarness) -> None:
    info = await h.kubelet().register()
    assert info.type == "DRAPlugin"
    assert info.name == DRIVER
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"]
    endpoint = Path(info.endpoint)
    assert endpoint.is_absolute() and endpoint == h.dra_socket and stat.S_ISSOCK(os.stat(endpoint).st_mode)
    assert h.registration_socket.name == "gpu-node-agent.nvidia.com-reg.sock"
    assert not h.registration_socket.name.startswith(".")
    assert await prepare_answers(endpoint)


async def test_waiting_for_a_kubelet_is_ready_with_a_note(h: DraHarness) -> None:
    readiness = h.m.readiness()
    assert readiness.ok and "waiting for the kubelet" in readiness.detail
    assert h.m.debug_state()["registration"]["status"] == "waiting"  # type: ignore[index]


async def test_notify_true_registers_and_kicks_the_publisher(h: DraHarness) -> None:
    await h.kubelet().register()
    assert h.m.readiness().ok and h.m.readiness().detail == ""
    assert h.m.registration.registered
    assert h.metric("gpu_agent_dra_registered") == 1.0
    assert h.metric("gpu_agent_dra_registration_notifications_total", result="registered") == 1.0
    assert h.publisher.kicks == 1


async def test_rejection_is_visible_answered_ok_and_recoverable(h: DraHarness) -> None:
    reason = "RegisterPlugin error -- no handler registered for plugin type: DRAPlugin at socket x"
    await h.kubelet().register(accept=False, reason=reason)  # answered OK: no exception
    readiness = h.m.readiness()
    assert not readiness.ok and reason in readiness.detail
    state = h.m.debug_state()["registration"]
    assert state["status"] == "rejected" and state["reason"] == reason  # type: ignore[index]
    assert h.metric("gpu_agent_dra_registered") == 0.0
    assert h.publisher.kicks == 0
    await h.kubelet().register()  # the kubelet retries later and accepts
    assert h.m.readiness().ok


async def test_kubelet_restart_reruns_the_handshake_on_the_same_sockets(h: DraHarness) -> None:
    await h.kubelet().register()
    inodes = (os.stat(h.dra_socket).st_ino, os.stat(h.registration_socket).st_ino)
    await h.kubelet().register()  # a restarted kubelet walks plugins_registry and asks again
    assert h.m.registration.info_calls == 2 and h.m.registration.notifications == 2
    assert (os.stat(h.dra_socket).st_ino, os.stat(h.registration_socket).st_ino) == inodes
    assert h.m.readiness().ok and h.publisher.kicks == 2


@pytest.mark.parametrize("which", ["registration", "dra"])
async def test_a_deleted_socket_comes_back(h: DraHarness, which: str) -> None:
    path = h.registration_socket if which == "registration" else h.dra_socket
    before = os.stat(path).st_ino
    path.unlink()
    await wait_for(lambda: path.exists() and os.stat(path).st_ino != before, what=f"{which} socket re-created")
    await h.kubelet().register()
    assert await prepare_answers(h.dra_socket)
    assert h.m.plugin.restarts == 1


async def test_stale_socket_file_is_replaced_but_a_served_one_is_never_taken() -> None:
    async with dra_harness(start=False) as h:
        h.dra_socket.parent.mkdir(parents=True)
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(str(h.dra_socket))
        stale.close()  # a crashed run's file: nobody listens
        h.registration_socket.parent.mkdir(parents=True)
        foreign = socket.socket(socket.AF_UNIX)
        foreign.bind(str(h.registration_socket))
        foreign.listen()  # someone else serves at our registration path
        try:
            await h.build()
            task = asyncio.create_task(h.m.run())
            await wait_for(lambda: h.m.plugin.registration.failures >= 1, what="registration refused")
            readiness = h.m.readiness()
            assert not readiness.ok and "another process is serving" in readiness.detail
            assert h.m.plugin.dra.serving and await prepare_answers(h.dra_socket)
            foreign.close()  # it went away: the plugin takes the path on its next try
            await wait_for(lambda: h.m.plugin.running, what="plugin serving")
            await h.kubelet().register()
            assert h.m.readiness().ok
        finally:
            foreign.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_endpoint_serves_before_the_registration_socket_exists() -> None:
    with short_tmpdir() as root:
        dra_socket = root / "plugins" / DRIVER / "dra.sock"
        registration_socket = root / "plugins_registry" / f"{DRIVER}-reg.sock"
        checked = asyncio.Event()
        release = asyncio.Event()
        seen: list[bool] = []

        async def self_check(path: Path) -> None:
            seen.append(await prepare_answers(path))  # the endpoint answers at this point
            checked.set()
            await release.wait()

        state = RegistrationState(driver_name=DRIVER, endpoint=dra_socket)
        plugin = KubeletPlugin(
            dra_socket=dra_socket,
            registration_socket=registration_socket,
            dra_handlers=[_EmptyPrepare()],
            registration_handlers=[RegistrationServicer(state, DraMetrics(None))],
            backoff=FAST_BACKOFF,
            self_check=self_check,
        )
        task = asyncio.create_task(plugin.run())
        try:
            await asyncio.wait_for(checked.wait(), 2)
            assert seen == [True]
            assert dra_socket.is_socket() and not registration_socket.exists()
            release.set()
            await wait_for(lambda: registration_socket.exists(), what="registration socket")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        # shutdown removes both: the registration socket first (that deregisters)
        assert not registration_socket.exists() and not dra_socket.exists()


class _EmptyPrepare:
    """A v1 DRAPlugin that answers an empty NodePrepareResources (the self-check's call)."""

    def __mapping__(self) -> dict[str, object]:
        import grpclib.const

        from agent._proto.dra_v1.k8s.io.kubelet.pkg.apis.dra import v1 as pb

        async def prepare(stream: object) -> None:
            await stream.recv_message()  # type: ignore[attr-defined]
            await stream.send_message(pb.NodePrepareResourcesResponse())  # type: ignore[attr-defined]

        return {
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources": grpclib.const.Handler(
                prepare,
                grpclib.const.Cardinality.UNARY_UNARY,
                pb.NodePrepareResourcesRequest,
                pb.NodePrepareResourcesResponse,
            )
        }


async def test_shutdown_removes_both_sockets() -> None:
    async with dra_harness() as h:
        await h.kubelet().register()
        await h.stop()
        assert not h.dra_socket.exists() and not h.registration_socket.exists()


async def test_socket_path_too_long_is_a_readiness_reason_not_a_crash() -> None:
    """The device plugin of a node that gives DRA no GPU must not go down with DRA's sockets."""
    async with dra_harness(start=False) as h:
        h.config = make_config(h.root / ("x" * 80))
        await h.build()
        task = asyncio.create_task(h.m.run())
        try:
            await wait_for(lambda: h.m.plugin.dra.last_error, what="the failed serve")
            assert "longer than 107 bytes" in h.m.plugin.dra.last_error
            readiness = h.m.readiness()
            assert not readiness.ok and "longer than 107 bytes" in readiness.detail  # GPUs are DRA's here
            h.set_owner(dict.fromkeys(h.ownership.current.gpus(), Owner.DEVICE_PLUGIN), "dp-only")
            readiness = h.m.readiness()
            assert readiness.ok and readiness.detail.startswith("no GPU of this node is given to DRA")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
