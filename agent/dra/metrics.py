"""Prometheus metrics of the DRA kubelet plugin, registered on the registry the app passes in."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from agent.dra.claims.errors import Reason

_CALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

PREPARE_RESULTS = ("prepared", "already-prepared", "error")
UNPREPARE_RESULTS = ("unprepared", "not-prepared", "error")


class DraMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        # a private registry when none is given, so that several instances (tests) never clash
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.prepares = Counter(
            "gpu_agent_dra_prepare_claims",
            "Claims NodePrepareResources answered, by result",
            ["result"],
            registry=registry,
        )
        self.unprepares = Counter(
            "gpu_agent_dra_unprepare_claims",
            "Claims NodeUnprepareResources answered, by result",
            ["result"],
            registry=registry,
        )
        self.errors = Counter(
            "gpu_agent_dra_claim_errors",
            "Per-claim failures by operation and reason",
            ["operation", "reason"],
            registry=registry,
        )
        self.call_seconds = Histogram(
            "gpu_agent_dra_call_duration_seconds",
            "NodePrepareResources / NodeUnprepareResources call handling time",
            ["method", "api"],
            registry=registry,
            buckets=_CALL_BUCKETS,
        )
        self.claim_seconds = Histogram(
            "gpu_agent_dra_claim_duration_seconds",
            "Time to prepare or unprepare one claim (API read, CDI and checkpoint write included)",
            ["operation"],
            registry=registry,
            buckets=_CALL_BUCKETS,
        )
        self.allocation_to_prepare = Histogram(
            "gpu_agent_dra_allocation_to_prepare_seconds",
            "Time from a claim's allocation (status.allocation.allocationTimestamp, where the cluster "
            "sets it) to its preparation on this node",
            registry=registry,
            buckets=(0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0),
        )
        self.checkpoint_writes = Counter(
            "gpu_agent_dra_checkpoint_writes", "Checkpoint writes by result", ["result"], registry=registry
        )
        self.checkpoint_corruptions = Counter(
            "gpu_agent_dra_checkpoint_corruptions",
            "Checkpoints found unusable (truncated, corrupt, newer version) and moved aside",
            registry=registry,
        )
        self.prepared = Gauge("gpu_agent_dra_prepared_claims", "Claims prepared on this node", registry=registry)
        self.registered = Gauge(
            "gpu_agent_dra_registered", "1 while the kubelet has accepted the DRA plugin", registry=registry
        )
        self.notifications = Counter(
            "gpu_agent_dra_registration_notifications",
            "NotifyRegistrationStatus calls from the kubelet, by result",
            ["result"],
            registry=registry,
        )
        self.health_streams = Gauge(
            "gpu_agent_dra_health_streams", "Open NodeWatchResources streams", registry=registry
        )
        for result in PREPARE_RESULTS:
            self.prepares.labels(result=result)
        for result in UNPREPARE_RESULTS:
            self.unprepares.labels(result=result)
        for reason in Reason:
            self.errors.labels(operation="prepare", reason=reason.value)
        for result in ("ok", "error"):
            self.checkpoint_writes.labels(result=result)
        for result in ("registered", "rejected"):
            self.notifications.labels(result=result)
