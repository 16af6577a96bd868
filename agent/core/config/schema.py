"""The node config (the mounted ConfigMap) as frozen dataclasses.

Every field has a default, so an empty file is a valid config. Field names are the YAML
keys; ``agent.core.config.loader`` validates a parsed document against these types and names
the offending field on error. Sections belong to the component that reads them; keep
each section's fields documented where they are declared.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from agent.base.errors import ConfigError


class Owner(StrEnum):
    """Which mechanism serves a physical GPU (with all its MIG devices and replicas)."""

    DEVICE_PLUGIN = "device-plugin"
    DRA = "dra"
    NONE = "none"


BackendName = Literal["auto", "nvml", "simulated"]


#: the DRA driver name by default: this project's own, never NVIDIA's DRA driver's ``gpu.nvidia.com``
DEFAULT_DRA_DRIVER = "gpu-node-agent.nvidia.com"


@dataclass(frozen=True, slots=True)
class PathsConfig:
    # the kubelet's --root-dir: plugins_registry/, plugins/<driver>/ and pod-resources/ live here
    kubelet_root: Path = Path("/var/lib/kubelet")
    # where the kubelet serves device plugins; a real kubelet uses /var/lib/kubelet/device-plugins
    # whatever its --root-dir says. Unset: <kubelet_root>/device-plugins (right for a stock kubelet)
    device_plugins_dir: Path | None = None
    cdi_root: Path = Path("/var/run/cdi")
    # the agent's own state (the DRA checkpoint); unset: the DRA plugin's data directory,
    # <kubelet_root>/plugins/<dra.driver_name>
    state_dir: Path | None = None
    # where the NVIDIA driver's files live: "/" or e.g. /run/nvidia/driver (driver container)
    driver_root: Path = Path("/")
    # where the host's container runtime sees driver_root (CDI specs name host paths), e.g.
    # /run/nvidia/driver when the pod mounts it at /driver-root; unset: the same as driver_root
    host_driver_root: Path | None = None


_COUNT_RE = re.compile(r"^count\s+(\d+)\s+within\s+(\d+(?:\.\d+)?)\s*(s|m|h)?$")
_UNITS = {None: 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True, slots=True)
class XidRule:
    """What one Xid means for health: ``ignore``, ``fatal`` or ``count N within T``."""

    action: Literal["ignore", "fatal", "count"]
    count: int = 1
    window_s: float = 0.0

    @classmethod
    def from_config(cls, value: Any, where: str) -> XidRule:
        if isinstance(value, XidRule):
            return value
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected 'ignore', 'fatal' or 'count N within T', got {value!r}")
        text = value.strip().lower()
        if text in ("ignore", "fatal"):
            return cls(action=text)  # type: ignore[arg-type]
        match = _COUNT_RE.fullmatch(text)
        if match is None:
            raise ConfigError(f"{where}: expected 'ignore', 'fatal' or 'count N within T', got {value!r}")
        count = int(match.group(1))
        window = float(match.group(2)) * _UNITS[match.group(3)]
        if count < 1 or window <= 0:
            raise ConfigError(f"{where}: count and window must be positive, got {value!r}")
        return cls(action="count", count=count, window_s=window)

    def describe(self) -> str:
        if self.action == "count":
            return f"count {self.count} within {self.window_s:g}s"
        return self.action


#: Xids caused by applications, not by the GPU (NVIDIA's device plugin skips the same set).
APPLICATION_XIDS = (13, 31, 43, 45, 68, 109)
#: Xids after which the GPU needs a reset before it can be trusted again.
RESET_REQUIRED_XIDS = (48, 79, 95, 119, 120, 154)


def _default_xids() -> dict[int, XidRule]:
    return {xid: XidRule(action="ignore") for xid in APPLICATION_XIDS}


@dataclass(frozen=True, slots=True)
class HealthConfig:
    enabled: bool = True
    # periodic checks (GPU lost, NVML garbage) and the rate at which CHECK_OK is reported
    check_interval_s: float = 5.0
    # how long a device must pass its checks before it returns to service (hysteresis)
    recovery_quiet_s: float = 60.0
    # bound on one NVML event wait, so that shutdown is noticed promptly
    event_wait_ms: int = 1000
    # rule for Xids not listed in ``xids``
    xid_default: XidRule = XidRule(action="fatal")
    # per-Xid rules; merged over the defaults (application Xids ignored)
    xids: dict[int, XidRule] = field(default_factory=_default_xids)
    # faults that keep a device unhealthy until the agent restarts or it is reset
    reset_required_xids: tuple[int, ...] = RESET_REQUIRED_XIDS
    ecc_double_bit: Literal["ignore", "fatal"] = "fatal"
    history_size: int = 20


@dataclass(frozen=True, slots=True)
class NodeMatch:
    names: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class NodeRule:
    match: NodeMatch = NodeMatch()
    default: Owner | None = None
    # by GPU UUID or index (as a string)
    gpus: dict[str, Owner] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class OwnershipConfig:
    default: Owner = Owner.DEVICE_PLUGIN
    nodes: tuple[NodeRule, ...] = ()
    # a handover still waiting for its GPU's users after this long is reported (a warning Event);
    # it is never forced
    handover_warning_s: float = 600.0


@dataclass(frozen=True, slots=True)
class TimeSlicingConfig:
    # each GPU is advertised as this many replica devices; 1 means no sharing
    replicas: int = 1
    # advertise replicas as "<resource>.shared" instead of "<resource>"
    rename_by_default: bool = False
    # refuse a request for several replicas of the same GPU
    fail_requests_greater_than_one: bool = False


@dataclass(frozen=True, slots=True)
class PluginConfig:
    """The kubelet device plugin (agent/plugin)."""

    enabled: bool = True
    resource_name: str = "nvidia.com/gpu"
    mig_strategy: Literal["none", "single", "mixed"] = "none"
    device_list_strategy: tuple[Literal["envvar", "volume-mounts", "cdi-annotations", "cdi-cri"], ...] = ("envvar",)
    device_id_strategy: Literal["uuid", "index"] = "uuid"
    replica_policy: Literal["pack", "spread"] = "spread"
    time_slicing: TimeSlicingConfig = TimeSlicingConfig()


@dataclass(frozen=True, slots=True)
class CdiConfig:
    """CDI spec generation and reconciliation (agent/cdi)."""

    enabled: bool = True
    device_plugin_kind: str = "k8s.gpu-node-agent.nvidia.com/gpu"
    claim_kind: str = "k8s.gpu-node-agent.nvidia.com/claim"
    reconcile_interval_s: float = 10.0
    # the NVIDIA CDI hook (nvidia-cdi-hook or nvidia-ctk) as the host sees it, written into
    # specs as given; unset: the first executable of the usual install paths
    hook_path: Path | None = None


class PublishMode(StrEnum):
    """How DRA publishes a GPU it owns (``dra.publish``)."""

    #: one device for the GPU (or, on a GPU in MIG mode, one per MIG device that exists)
    WHOLE = "whole"
    #: the whole GPU plus one device per MIG profile placement, sharing counters; the MIG
    #: instance is made when a claim is prepared and destroyed when it is unprepared
    DYNAMIC_MIG = "dynamic-mig"
    #: one device with ``allowMultipleAllocations`` and a ``memory`` capacity claims take shares of
    SHARED = "shared"


@dataclass(frozen=True, slots=True)
class PublishRule:
    """``dra.publish.nodes[i]``: matched like ``ownership.nodes`` (first match wins)."""

    match: NodeMatch = NodeMatch()
    default: PublishMode | None = None
    # by GPU UUID or index (as a string)
    gpus: dict[str, PublishMode] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PublishConfig:
    """``dra.publish``: a mode (``dra.publish: shared``), or a default with per-node and per-GPU rules."""

    default: PublishMode = PublishMode.WHOLE
    nodes: tuple[PublishRule, ...] = ()

    @classmethod
    def from_config(cls, value: Any, where: str) -> PublishConfig:
        if isinstance(value, PublishConfig):
            return value
        if isinstance(value, str):
            try:
                return cls(default=PublishMode(value))
            except ValueError:
                modes = " | ".join(repr(m.value) for m in PublishMode)
                raise ConfigError(f"{where}: expected one of {modes} or a mapping, got {value!r}") from None
        from agent.core.config.loader import convert_dataclass  # the loader imports this module

        publish: PublishConfig = convert_dataclass(cls, value, where)
        return publish


@dataclass(frozen=True, slots=True)
class SharingConfig:
    """GPUs published ``shared`` (``dra.publish``): the memory capacity claims ask for, and MPS."""

    # run one MPS control daemon per shared GPU and give each share a memory limit and a thread
    # percentage from the memory it was allocated; off: memory is only accounted by the scheduler
    # and the GPU's time is sliced by the driver
    mps: bool = False
    # what a claim that does not ask for memory gets (the capacity's requestPolicy default)
    default_memory_mib: int = 8192
    # the granularity of a share: requests are rounded up to a multiple of this (and at least one)
    memory_step_mib: int = 1024


@dataclass(frozen=True, slots=True)
class DraConfig:
    """The DRA kubelet plugin and its ResourceSlices (agent/dra); it serves the GPUs owned by ``dra``."""

    # spec.driver of the ResourceSlices, the plugin's registration name and its data directory
    driver_name: str = DEFAULT_DRA_DRIVER
    # how each DRA-owned GPU is published; live: a GPU whose mode changes while claims hold it
    # waits for them (unpublished meanwhile), as a handover does
    publish: PublishConfig = PublishConfig()
    sharing: SharingConfig = SharingConfig()


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """What ``/metrics`` and ``/debug/state`` sample and how much they show (agent/observe/utilization.py,
    agent/observe/metrics/gpus.py)."""

    # how often GPU and MIG utilization and memory are read from the backend (off the event loop);
    # a read that takes longer than this is abandoned
    utilization_interval_s: float = 10.0
    # a reading older than this many intervals reads as unknown (NVML failing or hung)
    utilization_stale_intervals: int = 3
    # holder series (gpu_agent_gpu_holder_info) on one scrape at most; the rest are counted as dropped
    # (a scrape runs on the event loop: 256 holders cost about 5 ms on a slow 2-core machine)
    max_holder_series: int = 256


@dataclass(frozen=True, slots=True)
class WatchdogConfig:
    """The registration watchdog (agent/observe/watchdog.py): what we advertise vs what the node shows."""

    enabled: bool = True
    # how often advertised and observed devices are compared (and the Node's status read)
    interval_s: float = 10.0
    # a disagreement shorter than this is the kubelet catching up (it posts node status every
    # 10 s; the PodResources view is refreshed every 10 s); a longer one is repaired
    grace_s: float = 30.0
    # repairs of one disagreement after which readiness fails
    max_repairs: int = 3


@dataclass(frozen=True, slots=True)
class OrphansConfig:
    """Orphaned allocations (agent/observe/orphans.py): held devices whose pod or claim is gone."""

    enabled: bool = True
    # how often held devices are checked against the API server
    interval_s: float = 30.0
    # API reads (pods, claims) one check may make; the rest wait for the next checks
    max_lookups: int = 20


@dataclass(frozen=True, slots=True)
class Config:
    backend: BackendName = "auto"
    # simulated node: a preset name or a YAML file
    preset: str = "h100-8x-nvlink"
    node_name: str = ""
    node_labels: dict[str, str] = field(default_factory=dict)
    debug_addr: str = "127.0.0.1:9477"
    kubeconfig: str = ""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # how often the backend is re-read to notice MIG reconfiguration, lost GPUs, driver upgrades
    inventory_refresh_s: float = 60.0
    paths: PathsConfig = PathsConfig()
    health: HealthConfig = HealthConfig()
    ownership: OwnershipConfig = OwnershipConfig()
    plugin: PluginConfig = PluginConfig()
    dra: DraConfig = DraConfig()
    cdi: CdiConfig = CdiConfig()
    metrics: MetricsConfig = MetricsConfig()
    watchdog: WatchdogConfig = WatchdogConfig()
    orphans: OrphansConfig = OrphansConfig()

    @property
    def device_plugins_dir(self) -> Path:
        """Where the kubelet's ``kubelet.sock`` and the device-plugin sockets live."""
        return self.paths.device_plugins_dir or self.paths.kubelet_root / "device-plugins"

    @property
    def pod_resources_socket(self) -> Path:
        """The kubelet's PodResources API (who holds which device)."""
        return self.paths.kubelet_root / "pod-resources" / "kubelet.sock"

    @property
    def dra_plugin_dir(self) -> Path:
        """The DRA plugin's data directory (its socket lives here): ``plugins/<driver>``."""
        return self.paths.kubelet_root / "plugins" / self.dra.driver_name

    @property
    def state_dir(self) -> Path:
        """Where the agent keeps its own state (the DRA checkpoint)."""
        return self.paths.state_dir or self.dra_plugin_dir


#: fields that only take effect when the agent starts (dotted: a field of a section); a live
#: reload keeps their old values
RESTART_ONLY_FIELDS = (
    "backend",
    "preset",
    "node_name",
    "debug_addr",
    "kubeconfig",
    "paths",
    "dra.driver_name",
    "cdi",
)
