"""Prometheus metrics of the device plugin, registered on the registry the app passes in."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


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
        self.registered = Gauge(
            "gpu_agent_plugin_registered",
            "1 while the kubelet holds a ListAndWatch stream of the resource (registered)",
            ["resource"],
            registry=registry,
        )
