"""Prometheus metrics of the device plugin, registered on the registry the app passes in."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class ReplicaView(Protocol):
    @property
    def resource(self) -> str: ...
    @property
    def gpu_uuid(self) -> str: ...
    @property
    def advertised(self) -> int: ...
    @property
    def allocated(self) -> int | None: ...


class PluginCollector(Collector):
    """Read at scrape time from the manager: time-sliced replicas and PodResources failures.

    Generated from live state, so a GPU or resource that goes takes its series with it.
    """

    def __init__(
        self, *, replicas: Callable[[], Sequence[ReplicaView]], pod_resources_failures: Callable[[], int]
    ) -> None:
        self._replicas = replicas
        self._failures = pod_resources_failures

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        family = GaugeMetricFamily(
            "gpu_agent_plugin_replicas",
            "Time-sliced replicas of a GPU: advertised in ListAndWatch, and allocated to containers "
            "(from PodResources; absent while unknown)",
            labels=["resource", "uuid", "state"],
        )
        for r in self._replicas():
            family.add_metric([r.resource, r.gpu_uuid, "advertised"], r.advertised)
            if r.allocated is not None:
                family.add_metric([r.resource, r.gpu_uuid, "allocated"], r.allocated)
        yield family
        yield CounterMetricFamily(
            "gpu_agent_plugin_podresources_errors",
            "Calls to the kubelet's PodResources API that failed (who holds which device is unknown meanwhile)",
            value=self._failures(),
        )


class PluginMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        # a private registry when none is given, so that several managers (tests) never clash
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.rpc_seconds = Histogram(
            "gpu_agent_plugin_rpc_duration_seconds",
            "Device plugin RPC handling time",
            ["resource", "method", "result"],
            registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
        )
        self.registrations = Counter(
            "gpu_agent_plugin_registrations_total",
            "Register calls to the kubelet by result",
            ["resource", "result"],
            registry=registry,
        )
        self.devices = Gauge(
            "gpu_agent_plugin_devices",
            "Devices advertised in ListAndWatch by health",
            ["resource", "health"],
            registry=registry,
        )
        self.serve_errors = Counter(
            "gpu_agent_plugin_serve_errors_total",
            "Device plugin servers that failed to serve on their socket (no permission, a file in the way, "
            "a self-check that failed)",
            ["resource"],
            registry=registry,
        )
        self.registered = Gauge(
            "gpu_agent_plugin_registered",
            "1 while the kubelet holds a ListAndWatch stream of the resource (registered)",
            ["resource"],
            registry=registry,
        )
