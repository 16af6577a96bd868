"""Per-GPU Prometheus series, generated from live state at scrape time.

Every series here is built when Prometheus scrapes, from the inventory, the health monitor, the
ownership table, the mechanisms' holders and the newest utilization reading. Nothing is kept
between scrapes, so a pod that is gone, a GPU that fell off the bus or an owner that changed
takes its series with it: the metric set follows the node, never the node's history.

Labels that come from outside (pod, container, claim names, product strings, health causes) are
cut to :data:`MAX_LABEL` characters; prometheus_client escapes them in the exposition. The
holder series are capped at ``metrics.max_holder_series`` per scrape, in a stable order (GPU
index, mechanism, namespace, name), and ``gpu_agent_gpu_holder_series_dropped`` says how many
were left out.

Join on ``uuid``: ``gpu_agent_gpu_info`` carries the product and owners, the holder info metric
who holds the GPU, e.g. ``gpu_agent_gpu_utilization_ratio * on(uuid) group_left(namespace, pod)
gpu_agent_gpu_holder_info``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from agent.core.config.current import ConfigState
from agent.core.health.model import HealthState
from agent.core.health.monitor import OTHER_XID
from agent.core.inventory.sample import MIB
from agent.core.mechanism import Mechanism
from agent.core.node import NodeFacts
from agent.observe.utilization import Utilization

#: longest label value taken from outside
MAX_LABEL = 128

GPU_LABELS = ["uuid", "index"]
HOLDER_LABELS = ["uuid", "index", "mechanism", "namespace", "pod", "pod_uid", "container", "claim", "claim_uid"]


class UtilizationSource(Protocol):
    def get(self, uuid: str) -> Utilization: ...


def _cut(value: str) -> str:
    return value if len(value) <= MAX_LABEL else value[: MAX_LABEL - 3] + "..."


class GpuCollector(Collector):
    def __init__(
        self,
        *,
        node: NodeFacts,
        mechanisms: Mapping[str, Mechanism],
        utilization: UtilizationSource,
        config: ConfigState,
        pod_uid: Callable[[str, str], str] = lambda namespace, name: "",
        claim_pods: Callable[[str, str, str], Sequence[tuple[str, str]]] = lambda namespace, name, uid: (),
    ) -> None:
        self._inventory = node.inventory
        self._health = node.health
        self._ownership = node.ownership
        self._mechanisms = mechanisms
        self._utilization = utilization
        self._config = config
        self._pod_uid = pod_uid
        self._claim_pods = claim_pods

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield from self._identity()
        yield from self._holders()
        yield from self._usage()

    def _identity(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        info = GaugeMetricFamily(
            "gpu_agent_gpu_info",
            "1 per physical GPU: product, granted owner (device-plugin, dra, none or draining:<from>-><to>) "
            "and the owner the config wants",
            labels=[*GPU_LABELS, "product", "owner", "desired_owner"],
        )
        health = GaugeMetricFamily(
            "gpu_agent_gpu_health",
            "1 per physical GPU, labelled with its health state (healthy, unhealthy, unknown) and the reason",
            labels=[*GPU_LABELS, "product", "owner", "state", "reason"],
        )
        xids = CounterMetricFamily(
            "gpu_agent_gpu_xid_events",
            "Xid events seen on a GPU (and its MIG devices) since the agent started, whatever the health "
            "policy made of them ('other': Xids past the per-GPU limit of distinct values)",
            labels=[*GPU_LABELS, "xid"],
        )
        granted, desired = self._ownership.current, self._ownership.desired
        for gpu in self._inventory.current.gpus:
            gpu_labels = [gpu.uuid, str(gpu.index)]
            product, owner = _cut(gpu.product_name), granted.state_of(gpu.uuid)
            info.add_metric([*gpu_labels, product, owner, desired.owner_of(gpu.uuid).value], 1)
            state = self._health.state(gpu.uuid)
            record = self._health.record(gpu.uuid)
            reason = _cut(record.cause) if record is not None and state is not HealthState.HEALTHY else ""
            health.add_metric([*gpu_labels, product, owner, state.value, reason], 1)
            for xid, n in sorted(self._health.xid_counts(gpu.uuid).items()):
                xids.add_metric([*gpu_labels, "other" if xid == OTHER_XID else str(xid)], n)
        yield info
        yield health
        yield xids

    def _holders(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "gpu_agent_gpu_holder_info",
            "1 per pod container (device plugin, from PodResources) or claim (DRA, from the checkpoint, with "
            "each pod it is reserved for once read) that holds a GPU; join on uuid",
            labels=HOLDER_LABELS,
        )
        limit = self._config.config.metrics.max_holder_series
        shown = dropped = 0
        usages = {name: m.usage() for name, m in sorted(self._mechanisms.items())}  # once per scrape
        for gpu in sorted(self._inventory.current.gpus, key=lambda g: g.index):
            for mechanism_name, usage in usages.items():
                holders = usage.holders.get(gpu.uuid, ())
                for h in sorted(holders, key=lambda h: (h.namespace, h.name, h.detail)):
                    if shown >= limit:  # past the cap only counted, never formatted
                        dropped += max(1, len(self._claim_pods(h.namespace, h.name, h.uid))) if h.kind == "claim" else 1
                        continue
                    if h.kind == "claim":  # one row per pod the claim is reserved for, when known
                        pods = self._claim_pods(h.namespace, h.name, h.uid) or (("", ""),)
                        values = [(h.namespace, pod, pod_uid, "", h.name, h.uid) for pod, pod_uid in pods]
                    else:
                        pod_uid = h.uid or self._pod_uid(h.namespace, h.name)
                        values = [(h.namespace, h.name, pod_uid, h.detail, "", "")]
                    for value in values:
                        if shown >= limit:
                            dropped += 1
                            continue
                        family.add_metric([gpu.uuid, str(gpu.index), mechanism_name, *(_cut(v) for v in value)], 1)
                        shown += 1
        yield family
        yield GaugeMetricFamily(
            "gpu_agent_gpu_holder_series_dropped",
            "Holders left out of gpu_agent_gpu_holder_info on this scrape (past metrics.max_holder_series)",
            value=dropped,
        )

    def _usage(self) -> Iterator[GaugeMetricFamily]:
        ratio = GaugeMetricFamily(
            "gpu_agent_gpu_utilization_ratio",
            "Share of the last sample period in which a kernel ran on the GPU, 0-1 (absent while unknown)",
            labels=GPU_LABELS,
        )
        used = GaugeMetricFamily(
            "gpu_agent_gpu_memory_used_bytes", "GPU memory in use (absent while unknown)", labels=GPU_LABELS
        )
        total = GaugeMetricFamily(
            "gpu_agent_gpu_memory_total_bytes", "GPU memory in all (absent while unknown)", labels=GPU_LABELS
        )
        known = GaugeMetricFamily(
            "gpu_agent_gpu_utilization_known",
            "1 while the GPU's newest utilization reading is fresh, 0 while it is unknown (failing or hung)",
            labels=GPU_LABELS,
        )
        mig_labels = ["uuid", "gpu_uuid", "profile"]
        mig_used = GaugeMetricFamily(
            "gpu_agent_mig_memory_used_bytes", "MIG device memory in use (absent while unknown)", labels=mig_labels
        )
        mig_total = GaugeMetricFamily(
            "gpu_agent_mig_memory_total_bytes", "MIG device memory in all (absent while unknown)", labels=mig_labels
        )
        for gpu in self._inventory.current.gpus:
            labels = [gpu.uuid, str(gpu.index)]
            reading = self._utilization.get(gpu.uuid)
            sample = reading.sample
            known.add_metric(labels, 1 if sample is not None else 0)
            if sample is not None:
                if sample.gpu_percent is not None:
                    ratio.add_metric(labels, sample.gpu_percent / 100.0)
                if sample.memory_used_mib is not None:
                    used.add_metric(labels, sample.memory_used_mib * MIB)
                if sample.memory_total_mib is not None:
                    total.add_metric(labels, sample.memory_total_mib * MIB)
            for mig in gpu.mig_devices:
                mig_sample = self._utilization.get(mig.uuid).sample
                mig_row = [mig.uuid, gpu.uuid, _cut(mig.profile)]
                if mig_sample is not None and mig_sample.memory_used_mib is not None:
                    mig_used.add_metric(mig_row, mig_sample.memory_used_mib * MIB)
                if mig_sample is not None and mig_sample.memory_total_mib is not None:
                    mig_total.add_metric(mig_row, mig_sample.memory_total_mib * MIB)
        yield from (ratio, used, total, known, mig_used, mig_total)
