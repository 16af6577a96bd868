"""Smaller signals for operators: the observability config and its validation, Xid counts, time from
allocation to preparation, slice counts and reconcile latency, and time-sliced replicas."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.backends.simulated import SimulatedBackend
from agent.base.errors import ConfigError
from agent.core.config.loader import build_config
from agent.core.config.schema import HealthConfig, PluginConfig, TimeSlicingConfig
from agent.core.health.model import Signal, SignalKind
from agent.core.health.monitor import MAX_XID_KINDS, OTHER_XID, HealthMonitor
from agent.deviceplugin.metrics import PluginCollector
from agent.deviceplugin.podresources import PodResourcesClient, PodResourcesWatcher
from agent.dra.devices import dra_devices
from tests.dra_fakes import dra_harness, result
from tests.fake_apiserver import FakeApiServer
from tests.fake_podresources import FakePodResources
from tests.test_dra_publisher import _inventory, _node, _published, api, publishing, until  # noqa: F401 - fixture
from tests.test_plugin_fakes import plugin_harness

# --- config ------------------------------------------------------------------------------------


def test_observability_defaults() -> None:
    config = build_config({})
    assert config.metrics.utilization_interval_s == 10.0 and config.metrics.utilization_stale_intervals == 3
    assert config.metrics.max_holder_series == 256
    assert (config.watchdog.enabled, config.watchdog.interval_s, config.watchdog.grace_s) == (True, 10.0, 30.0)
    assert config.orphans.interval_s == 30.0 and config.orphans.max_lookups == 20


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"metrics": {"utilization_interval_s": 0}}, "metrics.utilization_interval_s: must be a number of seconds"),
        ({"metrics": {"utilization_interval_s": float("nan")}}, "metrics.utilization_interval_s"),
        ({"metrics": {"utilization_interval_s": "often"}}, "metrics.utilization_interval_s: expected a number"),
        ({"metrics": {"utilization_stale_intervals": 0}}, "metrics.utilization_stale_intervals: must be at least 1"),
        ({"metrics": {"max_holder_series": -1}}, "metrics.max_holder_series: must be at least 0"),
        ({"metrics": {"sample_everything": True}}, "metrics.sample_everything"),
        ({"watchdog": {"grace_s": 0.001}}, "watchdog.grace_s: must be a number of seconds, at least 0.05"),
        ({"watchdog": {"interval_s": -1}}, "watchdog.interval_s"),
        ({"watchdog": {"max_repairs": 0}}, "watchdog.max_repairs: must be at least 1"),
        ({"orphans": {"interval_s": 0}}, "orphans.interval_s"),
        ({"orphans": {"max_lookups": 0}}, "orphans.max_lookups: must be at least 1"),
    ],
)
def test_bad_observability_config_is_one_line_naming_the_field(document: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(document)
    assert message in str(info.value) and "\n" not in str(info.value)


# --- Xids ---------------------------------------------------------------------------------------


async def test_xid_counts_per_gpu_include_its_mig_devices_and_stay_bounded() -> None:
    inventory = await SimulatedBackend(preset="a100-4x-mig", node_name="n", health=HealthConfig()).load()
    monitor = HealthMonitor(config=HealthConfig())
    monitor.set_inventory(inventory)
    gpu = next(g for g in inventory.gpus if g.mig_devices)
    monitor.observe(Signal(gpu.mig_devices[0].uuid, SignalKind.XID, xid=43))  # an application Xid: ignored
    monitor.observe(Signal(gpu.uuid, SignalKind.XID, xid=43))
    assert monitor.xid_counts(gpu.uuid) == {43: 2}
    other = inventory.gpus[-1].uuid
    for xid in range(1000, 1000 + MAX_XID_KINDS + 8):  # a driver that sends garbage Xids
        monitor.observe(Signal(other, SignalKind.XID, xid=xid))
    counts = monitor.xid_counts(other)
    assert len(counts) == MAX_XID_KINDS + 1 and counts[OTHER_XID] == 8


# --- DRA -----------------------------------------------------------------------------------------


def _iso(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.integration
async def test_time_from_allocation_to_prepare_is_observed_where_the_claim_says() -> None:
    async with dra_harness() as h:
        await h.kubelet().register()
        now = datetime.now(UTC)
        timed = h.claims.add("timed", result("gpu-0"), allocation_timestamp=_iso(now - timedelta(seconds=30)))
        untimed = h.claims.add("untimed", result("gpu-1"))
        skewed = h.claims.add("skewed", result("gpu-2"), allocation_timestamp=_iso(now + timedelta(hours=1)))
        for ref in (timed, untimed, skewed):
            assert (await h.prepare(ref)).claims[ref.uid].error == ""
        assert h.metric("gpu_agent_dra_allocation_to_prepare_seconds_count") == 1
        assert 29 <= h.metric("gpu_agent_dra_allocation_to_prepare_seconds_sum") < 3600
        assert h.metric("gpu_agent_dra_claim_duration_seconds_count", operation="prepare") == 3


@pytest.mark.integration
async def test_slice_count_and_reconcile_latency_and_the_watchdogs_view(api: FakeApiServer, tmp_path: Path) -> None:  # noqa: F811
    inventory = await _inventory()
    node = _node(inventory)
    async with publishing(api, tmp_path, node) as publisher:
        names = [d.name for d in dra_devices(inventory)]
        await _published(api, publisher, names)
        value = node.registry.get_sample_value
        assert value("gpu_agent_dra_resource_slices") == 1
        assert (value("gpu_agent_dra_slice_sync_duration_seconds_count", {"result": "ok"}) or 0) >= 1
        assert publisher.slice_check() == (frozenset(names), frozenset(names))
        lists = api.count("GET", "/resourceslices", watch=False)
        writes = api.slice_writes()
        publisher.resync()  # the watchdog's repair: read the slices again, write only what differs
        await until(lambda: api.count("GET", "/resourceslices", watch=False) > lists, "a fresh list")
        await _published(api, publisher, names)
        assert api.slice_writes() == writes


# --- time-sliced replicas --------------------------------------------------------------------------


@pytest.mark.integration
async def test_replicas_advertised_and_allocated_per_gpu() -> None:
    sharing = PluginConfig(time_slicing=TimeSlicingConfig(replicas=4))
    async with plugin_harness(sharing) as h:
        await h.settled()
        pods = FakePodResources(h.root / "pod-resources")
        await pods.start()
        try:
            watcher = PodResourcesWatcher(PodResourcesClient(pods.socket))
            h.manager.pod_resources = watcher
            gpu0, gpu1 = h.gpu(0), h.gpu(1)
            pods.allocate("ml", "a", "main", "nvidia.com/gpu", [f"{gpu0}::0", f"{gpu0}::3"])
            pods.allocate("ml", "b", "main", "nvidia.com/gpu", [f"{gpu1}::2"])
            assert {r.allocated for r in h.manager.replica_counts()} == {None}  # no answer yet: unknown
            await watcher.poll()
            counts = {r.gpu_uuid: (r.advertised, r.allocated) for r in h.manager.replica_counts()}
            assert counts[gpu0] == (4, 2) and counts[gpu1] == (4, 1) and counts[h.gpu(5)] == (4, 0)
            registry = CollectorRegistry()
            registry.register(PluginCollector(replicas=h.manager.replica_counts, pod_resources_failures=lambda: 0))
            labels = {"resource": "nvidia.com/gpu", "uuid": gpu0}
            assert registry.get_sample_value("gpu_agent_plugin_replicas", {**labels, "state": "allocated"}) == 2
            assert registry.get_sample_value("gpu_agent_plugin_replicas", {**labels, "state": "advertised"}) == 4
            assert h.manager.debug_state()["replicas"][0] == {  # type: ignore[index]
                "resource": "nvidia.com/gpu",
                "gpu": h.gpu(0),
                "advertised": 4,
                "allocated": 2,
            }
        finally:
            await pods.stop()
