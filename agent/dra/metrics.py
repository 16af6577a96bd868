"""Prometheus metrics of the DRA kubelet plugin, registered on the registry the app passes in."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agent.core.inventory.current import InventoryState
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


class PartitionCollector(Collector):
    """Per-GPU partitioning series, built at scrape time from the DRA mechanism's per-GPU view.

    ``gpu_agent_dra_publish_mode`` (1 per GPU: the mode it is published in, or
    ``changing-><mode>``, and the wished one), ``gpu_agent_dra_mig_partitions`` (MIG instances made
    for claims, by profile), ``gpu_agent_dra_free_memory_slices``, ``gpu_agent_dra_shares`` and
    ``gpu_agent_dra_shared_memory_{allocated,free}_bytes``.
    """

    def __init__(self, details: Callable[[], Mapping[str, Mapping[str, object]]], *, inventory: InventoryState) -> None:
        self._details = details
        self._inventory = inventory

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # families are built at scrape time

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["uuid", "index"]
        mode = GaugeMetricFamily(
            "gpu_agent_dra_publish_mode",
            "1 per GPU: its DRA publish mode now and the one wished",
            labels=[*labels, "mode", "desired"],
        )
        parts = GaugeMetricFamily(
            "gpu_agent_dra_mig_partitions",
            "MIG instances made for prepared claims, by profile",
            labels=[*labels, "profile"],
        )
        slices = GaugeMetricFamily(
            "gpu_agent_dra_free_memory_slices",
            "Memory slices of a dynamic-mig GPU no prepared partition holds",
            labels=labels,
        )
        shares = GaugeMetricFamily("gpu_agent_dra_shares", "Shares prepared on a shared GPU", labels=labels)
        allocated = GaugeMetricFamily(
            "gpu_agent_dra_shared_memory_allocated_bytes",
            "Memory of a shared GPU its prepared shares hold",
            labels=labels,
        )
        free = GaugeMetricFamily(
            "gpu_agent_dra_shared_memory_free_bytes", "Memory of a shared GPU no prepared share holds", labels=labels
        )
        details = self._details()
        for gpu in sorted(self._inventory.current.gpus, key=lambda g: g.index):
            found = details.get(gpu.uuid)
            if not found:
                continue
            ids = [gpu.uuid, str(gpu.index)]
            publish = found.get("publish")
            if isinstance(publish, dict):
                mode.add_metric([*ids, str(publish.get("state")), str(publish.get("desired"))], 1)
            by_profile: dict[str, int] = {}
            for p in _dicts(found.get("partitions")):
                profile = str(p.get("profile") or p.get("profile_id"))
                by_profile[profile] = by_profile.get(profile, 0) + 1
            for profile, n in sorted(by_profile.items()):
                parts.add_metric([*ids, profile], n)
            counters = found.get("free_counters")
            if isinstance(counters, dict):
                slices.add_metric(ids, sum(v for k, v in counters.items() if str(k).startswith("memory-slice-")))
            memory = found.get("shared_memory")
            if isinstance(memory, dict):
                held = _dicts(found.get("shares"))
                shares.add_metric(ids, len(held))
                allocated.add_metric(ids, sum(int(str(s.get("memory_bytes", 0))) for s in held))
                free.add_metric(ids, float(str(memory.get("free_bytes", 0))))
        yield from (mode, parts, slices, shares, allocated, free)


def _dicts(value: object) -> list[dict[str, object]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []
