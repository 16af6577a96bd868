"""Prometheus metrics of the API client, registered on the registry the composition root passes in."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class KubeMetrics:
    """Latency of every API request by verb, resource and result, and errors by status code.

    ``result`` is ``ok``, the HTTP status (``404``, ``409``, ...), ``timeout``, ``connection`` or
    ``too-large``; ``code`` on the error counter is the same value.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # a private registry when none is given, so that several clients (tests) never clash
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.request_seconds = Histogram(
            "gpu_agent_kube_request_duration_seconds",
            "Kubernetes API request time (watches: until the stream opened)",
            ["verb", "resource", "result"],
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
        )
        self.errors = Counter(
            "gpu_agent_kube_request_errors_total",
            "Kubernetes API requests that failed, by verb, resource and status code or failure kind",
            ["verb", "resource", "code"],
            registry=registry,
        )

    def observe(self, verb: str, resource: str, result: str, seconds: float) -> None:
        self.request_seconds.labels(verb=verb, resource=resource, result=result).observe(seconds)
        if result != "ok":
            self.errors.labels(verb=verb, resource=resource, code=result).inc()
