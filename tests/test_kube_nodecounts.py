"""NodeCountsGuard against the fake API server: the Node's counts of the agent's resources are
lowered to what the device plugin offers (never raised), a kubelet write that raises them again is
undone, and how long they have held is what a closing GPU waits on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from agent.core.mechanism import NodeCeiling
from agent.kube.access import kubeconfig_access
from agent.kube.client import KubeClient
from agent.kube.nodecounts import NodeCountsGuard
from tests.fake_apiserver import NODE, TIMEOUT, FakeApiServer, serving, write_kubeconfig
from tests.fake_sleep import FakeSleep

GPU = "nvidia.com/gpu"
MIG = "nvidia.com/mig-1g.10gb"


async def until(condition: Callable[[], object], what: str) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not condition():  # noqa: ASYNC110 - the state is the fake server's
            await asyncio.sleep(0.005)


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    async with serving() as fake:
        fake.add_node(NODE)
        fake.set_allocatable({GPU: "8", "cpu": "16", "example.com/other": "3"})  # the kubelet's last status
        yield fake


@contextlib.asynccontextmanager
async def guarding(api: FakeApiServer, tmp_path: Path, **kwargs: object) -> AsyncIterator[NodeCountsGuard]:
    async with KubeClient(kubeconfig_access(write_kubeconfig(tmp_path, api.url))) as client:
        guard = NodeCountsGuard(client, node_name=NODE, **kwargs)  # type: ignore[arg-type]
        task = asyncio.create_task(guard.run())
        try:
            yield guard
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def status(api: FakeApiServer, field: str = "allocatable") -> dict[str, str]:
    return dict(api.nodes[NODE]["status"][field])


async def test_counts_above_the_ceiling_are_lowered_with_a_guarded_patch(api: FakeApiServer, tmp_path: Path) -> None:
    async with guarding(api, tmp_path) as guard:
        assert guard.held_since(GPU) is None
        guard.lower_to({GPU: NodeCeiling(capacity=5, allocatable=4)})
        await until(lambda: guard.held_since(GPU) is not None, "held")
        assert status(api) == {GPU: "4", "cpu": "16", "example.com/other": "3"}  # nothing else touched
        assert status(api, "capacity")[GPU] == "5"
        (patch,) = api.node_status_patches
        assert patch["metadata"]["resourceVersion"]  # a precondition: a kubelet write in between is a 409
        assert patch["status"] == {"allocatable": {GPU: "4"}, "capacity": {GPU: "5"}}


async def test_counts_are_never_raised(api: FakeApiServer, tmp_path: Path) -> None:
    api.set_allocatable({GPU: "2"})
    async with guarding(api, tmp_path) as guard:
        guard.lower_to({GPU: NodeCeiling(capacity=8, allocatable=8), MIG: NodeCeiling(capacity=2, allocatable=2)})
        await until(lambda: guard.held_since(GPU) is not None and guard.held_since(MIG) is not None, "held")
        assert api.node_status_patches == [] and status(api) == {GPU: "2"}  # absent counts as none


async def test_a_kubelet_write_in_between_is_read_again_from_etcd(api: FakeApiServer, tmp_path: Path) -> None:
    api.fail(409, times=1, method="PATCH", message="the object has been modified")
    async with guarding(api, tmp_path) as guard:
        guard.lower_to({GPU: NodeCeiling(capacity=4, allocatable=4)})
        await until(lambda: guard.held_since(GPU) is not None, "held")
        assert guard.conflicts == 1 and status(api)[GPU] == "4"
        reads = [r.query for r in api.requests if r.method == "GET" and r.path == f"/api/v1/nodes/{NODE}"]
        assert reads[0] == {"resourceVersion": "0"} and reads[1] == {}  # the cache first, then etcd


async def test_a_kubelet_status_sync_that_raises_the_count_again_is_undone(api: FakeApiServer, tmp_path: Path) -> None:
    """The kubelet computed its status while the plugin still listed a closing GPU: its write
    brings the count back up; the guard notices on its next read and lowers it again."""
    async with guarding(api, tmp_path) as guard:
        guard.lower_to({GPU: NodeCeiling(capacity=4, allocatable=4)})
        await until(lambda: guard.held_since(GPU) is not None, "held")
        first = guard.held_since(GPU)
        api.set_allocatable({GPU: "8"})
        await until(lambda: len(api.node_status_patches) == 2, "lowered again")
        await until(lambda: guard.held_since(GPU) is not None, "held again")
        assert guard.held_since(GPU) != first and status(api)[GPU] == "4"


async def test_a_lower_ceiling_starts_the_hold_over_and_a_higher_one_does_not(
    api: FakeApiServer, tmp_path: Path
) -> None:
    async with guarding(api, tmp_path) as guard:
        guard.lower_to({GPU: NodeCeiling(capacity=8, allocatable=8)})
        await until(lambda: guard.held_since(GPU) is not None, "held")
        held = guard.held_since(GPU)
        guard.lower_to({GPU: NodeCeiling(capacity=8, allocatable=8)})  # the same: nothing new
        assert guard.held_since(GPU) == held
        guard.lower_to({GPU: NodeCeiling(capacity=7, allocatable=6)})
        assert guard.held_since(GPU) is None
        await until(lambda: guard.held_since(GPU) is not None, "held")
        held = guard.held_since(GPU)
        guard.lower_to({GPU: NodeCeiling(capacity=8, allocatable=8)})
        assert guard.held_since(GPU) == held


async def test_a_refused_patch_is_retried_and_never_held(api: FakeApiServer, tmp_path: Path) -> None:
    api.fail(403, times=None, method="PATCH", message='nodes "gpu-node" is forbidden: ValidatingAdmissionPolicy')
    sleep = FakeSleep()
    async with guarding(api, tmp_path, sleep=sleep) as guard:
        guard.lower_to({GPU: NodeCeiling(capacity=4, allocatable=4)})
        await sleep.release()  # the first refusal, then the retry
        retry = await sleep.next()
        assert guard.held_since(GPU) is None and "403" in guard.last_error
        assert status(api)[GPU] == "8"
        api.clear()
        retry.set_result(None)
        await until(lambda: guard.held_since(GPU) is not None, "held once the patch goes through")
        assert guard.last_error == ""
