"""Simulated node descriptions (presets): the file format, loading, and building an Inventory.

Preset files (built-ins live in ``agent/backends/presets/``; see ``docs/simulated.md``)::

    name: my-node                 # used in derived UUIDs; default: the file name without .yaml
    description: free text
    driver_version: "570.124.06"  # default shown; quote versions so YAML keeps them strings
    cuda_driver_version: "12.8"
    defaults:                     # every GPU inherits these unless it sets its own
      product_name: NVIDIA H100 80GB HBM3
      architecture: hopper
      compute_capability: "9.0"
      memory_mib: 81559
      numa_node: 0
      brand: Nvidia               # NVML's brand as NVIDIA's DRA driver spells it (default Nvidia)
      mig_model: h100-80gb        # the GPU's MIG profile table (agent.backends.migprofiles)
    mig_profiles: {1g.10gb: 9856}  # MiB per MIG profile; default: the model's, else <N>gb * 1024
    gpus:                         # one entry per GPU, in index order
      - pci_bus_id: "00000000:18:00.0"   # default 00000000:<index + 1>:00.0
        # also: index, minor, uuid (GPU-...), any defaults field, mig_enabled, pcie_root
        # (default: pci0000:00 on NUMA node 0, pci0000:80 on node 1, pci<node>:00 beyond)
        mig: [1g.10gb, {profile: 3g.40gb, gpu_instance_id: 2, uuid: MIG-...}]
    topology:
      nvlinks: 18                 # NVLinks between every pair of GPUs (default 0)
      pcie: system                # PCIe level of every pair: internal | single | multiple |
      pcie_same_numa: node        #   hostbridge | node | system; the second applies to
      pairs:                      #   pairs that share a NUMA node
        - {gpus: [0, 1], nvlinks: 4, pcie: single}   # explicit pairs win

UUIDs not given in the file are ``uuid5(namespace, "<node>/<preset>/gpu/<index>[/mig/<n>]")``
written as ``GPU-<uuid>`` / ``MIG-<uuid>``, so two nodes running the same preset never share a
UUID. A GPU with a ``mig_model`` can do MIG: it offers that model's profiles and placements
(``Gpu.mig_profiles``), and its listed MIG devices must be profiles of the model. MIG devices
are placed as the driver places them, and their GPU-instance ids follow the placement
(:func:`agent.backends.migprofiles.gpu_instance_id`; on A100/H100-class GPUs 7g: 0, 4g: 1,
3g: 1-2, 2g: 3-5, 1g: 7-13); compute instance ids default to 0; capability minors follow
``/proc/driver/nvidia-caps/mig-minors``.
"""

from __future__ import annotations

import re
import uuid as uuidlib
from dataclasses import dataclass, field, replace
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Literal

from agent.backends.migprofiles import MODELS, MigModel, cap_minors, gpu_instance_id, placement_of
from agent.base.errors import ConfigError
from agent.core.config.loader import convert, convert_dataclass, parse_yaml_mapping
from agent.core.config.reader import read_file_bounded
from agent.core.inventory.model import (
    Gpu,
    Inventory,
    Link,
    MigDevice,
    MigPlacement,
    MigProfile,
    PcieLevel,
    link_key,
)

DEFAULT_PRESET = "h100-8x-nvlink"
_UUID_NAMESPACE = uuidlib.uuid5(uuidlib.NAMESPACE_DNS, "simulated.gpu-node-agent")

PcieName = Literal["internal", "single", "multiple", "hostbridge", "node", "system"]


# --- preset schema (validated with agent.core.config.loader.convert) ---------------------


class VersionText(str):
    """A version string that YAML may have read as a number (``9.0``, ``12.8``)."""

    @classmethod
    def from_config(cls, value: Any, where: str) -> VersionText:
        if isinstance(value, str) and value.strip():
            return cls(value.strip())
        if isinstance(value, int | float) and not isinstance(value, bool):
            return cls(repr(value))
        raise ConfigError(f'{where}: expected a version string such as "9.0", got {value!r}')


class MigModelName(str):
    """A key of :data:`agent.backends.migprofiles.MODELS`."""

    @classmethod
    def from_config(cls, value: Any, where: str) -> MigModelName:
        if isinstance(value, str) and value in MODELS:
            return cls(value)
        raise ConfigError(f"{where}: expected one of {', '.join(MODELS)}, got {value!r}")


DRIVER_VERSION = VersionText("570.124.06")
CUDA_DRIVER_VERSION = VersionText("12.8")


@dataclass(frozen=True, slots=True)
class MigSpec:
    profile: str
    memory_mib: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int = 0
    uuid: str | None = None

    @classmethod
    def from_config(cls, value: Any, where: str) -> MigSpec:
        """A bare profile name (``1g.5gb``) or a mapping with the fields above."""
        if isinstance(value, str):
            return cls(profile=value)
        spec: MigSpec = convert_dataclass(cls, value, where)
        return spec


@dataclass(frozen=True, slots=True)
class GpuDefaults:
    product_name: str | None = None
    architecture: str | None = None
    compute_capability: VersionText | None = None
    memory_mib: int | None = None
    numa_node: int | None = None
    brand: str | None = None
    mig_model: MigModelName | None = None


@dataclass(frozen=True, slots=True)
class GpuSpec:
    index: int | None = None
    minor: int | None = None
    uuid: str | None = None
    product_name: str | None = None
    architecture: str | None = None
    compute_capability: VersionText | None = None
    memory_mib: int | None = None
    pci_bus_id: str | None = None
    numa_node: int | None = None
    brand: str | None = None
    pcie_root: str | None = None
    mig_model: MigModelName | None = None
    mig_enabled: bool | None = None  # default: true when ``mig`` lists devices
    mig: tuple[MigSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class PairSpec:
    gpus: tuple[int, ...]
    nvlinks: int | None = None
    pcie: PcieName | None = None


@dataclass(frozen=True, slots=True)
class TopologySpec:
    nvlinks: int = 0
    pcie: PcieName = "system"
    pcie_same_numa: PcieName | None = None
    pairs: tuple[PairSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class PresetSpec:
    name: str = ""
    description: str = ""
    driver_version: VersionText = DRIVER_VERSION
    cuda_driver_version: VersionText = CUDA_DRIVER_VERSION
    defaults: GpuDefaults = GpuDefaults()
    mig_profiles: dict[str, int] = field(default_factory=dict)
    gpus: tuple[GpuSpec, ...] = ()
    topology: TopologySpec = TopologySpec()


# --- reading presets ------------------------------------------------------------------


def _preset_dir() -> Traversable:
    return resources.files("agent.backends").joinpath("presets")


def preset_names() -> list[str]:
    """The built-in presets, sorted."""
    return sorted(p.name[: -len(".yaml")] for p in _preset_dir().iterdir() if p.name.endswith(".yaml"))


@dataclass(frozen=True, slots=True)
class LoadedPreset:
    key: str  # names the preset in derived UUIDs: the file's ``name`` field, else its stem
    label: str  # "preset NAME" or "preset file PATH", the prefix of every error about it
    spec: PresetSpec


def load_preset(preset: str) -> LoadedPreset:
    """A built-in preset by name, or a YAML preset file by path; ConfigError otherwise.

    A file is read like the config file (a regular file of at most 1 MiB, never blocking on a
    FIFO); it can take a while to parse, so callers on the event loop run this in a thread.
    """
    if preset in preset_names():
        label = f"preset {preset}"
        data = _preset_dir().joinpath(f"{preset}.yaml").read_bytes()
        stem = preset
    else:
        path = Path(preset).expanduser()
        if not preset or not (path.suffix in (".yaml", ".yml") or "/" in preset or path.is_file()):
            known = ", ".join(preset_names())
            raise ConfigError(f"unknown preset {preset!r} (known presets: {known}; or give a path to a YAML file)")
        label = f"preset file {path}"
        data = read_file_bounded(path, label=label)
        stem = path.stem
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{label} is not UTF-8 text (bad byte at offset {exc.start})") from exc
    spec = parse_preset(text, label)
    return LoadedPreset(key=spec.name or stem, label=label, spec=spec)


def parse_preset(text: str, label: str) -> PresetSpec:
    """Validate preset YAML; errors are one line: ``<label>: <field>: <problem>``."""
    doc = parse_yaml_mapping(text, label)
    try:
        spec: PresetSpec = convert(PresetSpec, doc, "")
    except ConfigError as exc:
        raise ConfigError(f"{label}: {exc}") from exc
    return spec


# --- building the inventory -------------------------------------------------------------

DEFAULT_BRAND = "Nvidia"
_PCIE_ROOT = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")
_BUS_ID = re.compile(r"^(?:[0-9A-Fa-f]{4}|[0-9A-Fa-f]{8}):[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$")
_PROFILE = re.compile(r"^(\d+)g\.(\d+)gb(?:\+me)?$")
# Without a model: the A100/H100 geometry, 7 compute slices over 8 memory slices, per
# compute-slice count (memory slices per instance, start slices)
_GENERIC_SLICES = 8
_GENERIC_SHAPES = {1: (1, (0, 1, 2, 3, 4, 5, 6)), 2: (2, (0, 2, 4)), 3: (4, (0, 4)), 4: (4, (0,)), 7: (8, (0,))}


def derived_uuid(prefix: str, node_name: str, preset_key: str, *path: int | str) -> str:
    name = "/".join([node_name, preset_key, *map(str, path)])
    return f"{prefix}-{uuidlib.uuid5(_UUID_NAMESPACE, name)}"


def build_inventory(spec: PresetSpec, *, preset_key: str, node_name: str, label: str) -> Inventory:
    try:
        gpus = tuple(_build_gpu(spec, i, node_name, preset_key) for i in range(len(spec.gpus)))
        _check_unique(gpus)
        links = _build_links(spec.topology, gpus)
    except ConfigError as exc:
        raise ConfigError(f"{label}: {exc}") from exc
    return Inventory(
        backend="simulated",
        driver_version=str(spec.driver_version),
        cuda_driver_version=str(spec.cuda_driver_version),
        gpus=gpus,
        links=links,
    )


def _build_gpu(spec: PresetSpec, position: int, node_name: str, preset_key: str) -> Gpu:
    g, d, where = spec.gpus[position], spec.defaults, f"gpus[{position}]"

    def required(name: str) -> Any:
        value = getattr(g, name)
        value = getattr(d, name) if value is None else value
        if value is None:
            raise ConfigError(f"{where}.{name}: not set here or in defaults")
        return value

    index = position if g.index is None else g.index
    minor = index if g.minor is None else g.minor
    memory = required("memory_mib")
    if index < 0 or minor < 0 or memory <= 0:
        raise ConfigError(f"{where}: index and minor must not be negative, memory_mib must be positive")
    uuid = g.uuid or derived_uuid("GPU", node_name, preset_key, "gpu", index)
    if not uuid.startswith("GPU-"):
        raise ConfigError(f"{where}.uuid: GPU UUIDs start with 'GPU-', got {uuid!r}")
    bus = g.pci_bus_id or f"00000000:{(index + 1) % 256:02X}:00.0"
    if not _BUS_ID.fullmatch(bus):
        raise ConfigError(f"{where}.pci_bus_id: expected DDDDDDDD:BB:DD.F, got {bus!r}")
    bus = bus.upper() if len(bus) == 16 else "0000" + bus.upper()
    mig_enabled = bool(g.mig) if g.mig_enabled is None else g.mig_enabled
    if g.mig and not mig_enabled:
        raise ConfigError(f"{where}.mig: MIG devices listed but mig_enabled is false")
    model_key = g.mig_model or d.mig_model
    profiles = _model_profiles(MODELS[model_key], spec.mig_profiles) if model_key else ()
    shape = _MigShape(MODELS[model_key].memory_slices if model_key else _GENERIC_SLICES, profiles)
    migs = _build_migs(spec, g, uuid, index, minor, node_name, preset_key, where, shape)
    numa = g.numa_node if g.numa_node is not None else d.numa_node
    root = g.pcie_root or default_pcie_root(numa)
    if not _PCIE_ROOT.fullmatch(root):
        raise ConfigError(f"{where}.pcie_root: expected pci<domain>:<bus> such as pci0000:00, got {root!r}")
    return Gpu(
        uuid=uuid,
        index=index,
        minor=minor,
        product_name=required("product_name"),
        architecture=required("architecture"),
        compute_capability=str(required("compute_capability")),
        memory_mib=memory,
        pci_bus_id=bus,
        numa_node=numa,
        mig_enabled=mig_enabled,
        mig_devices=migs,
        brand=g.brand or d.brand or DEFAULT_BRAND,
        pcie_root=root,
        mig_memory_slices=shape.memory_slices if profiles else 0,
        mig_profiles=profiles,
    )


def _model_profiles(model: MigModel, memory: dict[str, int]) -> tuple[MigProfile, ...]:
    """The model's profiles, with the preset's ``mig_profiles`` memory where it names one."""
    return tuple(replace(p, memory_mib=memory.get(p.name, p.memory_mib)) for p in model.profiles)


def default_pcie_root(numa_node: int | None) -> str:
    """A plausible root complex per NUMA node: two-socket servers split buses at 0x80."""
    node = numa_node or 0
    if node < 2:
        return f"pci0000:{node * 0x80:02x}"
    return f"pci{node:04x}:00"


@dataclass(frozen=True, slots=True)
class _MigShape:
    """Where a GPU's MIG devices may sit: its model's profiles, or the generic geometry."""

    memory_slices: int
    profiles: tuple[MigProfile, ...]

    def placements(self, name: str, where: str) -> tuple[tuple[MigPlacement, ...], MigProfile | None]:
        if self.profiles:
            profile = next((p for p in self.profiles if p.name == name), None)
            if profile is None:
                known = ", ".join(p.name for p in self.profiles)
                raise ConfigError(f"{where}.profile: {name!r} is not a profile of this GPU (known: {known})")
            return profile.placements, profile
        match = _PROFILE.fullmatch(name)
        if match is None:
            raise ConfigError(f"{where}.profile: expected <N>g.<M>gb, got {name!r}")
        size, starts = _GENERIC_SHAPES.get(int(match.group(1)), (0, ()))
        return tuple(MigPlacement(start=s, size=size) for s in starts), None


def _build_migs(
    spec: PresetSpec,
    g: GpuSpec,
    parent: str,
    index: int,
    minor: int,
    node_name: str,
    preset_key: str,
    where: str,
    shape: _MigShape,
) -> tuple[MigDevice, ...]:
    if len(g.mig) > shape.memory_slices:  # every instance takes a memory slice; bounds the fitting
        raise ConfigError(f"{where}.mig: {len(g.mig)} MIG devices, a GPU holds at most {shape.memory_slices}")
    options: list[tuple[MigPlacement, ...]] = []
    profiles: list[MigProfile | None] = []
    for j, m in enumerate(g.mig):
        placements, profile = shape.placements(m.profile, f"{where}.mig[{j}]")
        if m.gpu_instance_id is None and not placements:
            raise ConfigError(f"{where}.mig[{j}]: no automatic placement for {m.profile!r}; set gpu_instance_id")
        if m.memory_mib is not None and m.memory_mib <= 0:
            raise ConfigError(f"{where}.mig[{j}].memory_mib: must be positive, got {m.memory_mib}")
        options.append(placements)
        profiles.append(profile)
    placed = _place(g.mig, options, shape.memory_slices, where)
    out: list[MigDevice] = []
    for j, m in enumerate(g.mig):
        placement = placed[j]
        gi = m.gpu_instance_id
        if gi is None and placement is not None:  # auto-placed: the id follows the placement
            gi = gpu_instance_id(placement, shape.memory_slices)
        ci = m.compute_instance_id
        if gi is None or not 0 <= gi <= 14 or not 0 <= ci <= 7:
            raise ConfigError(f"{where}.mig[{j}]: gpu_instance_id must be 0-14 and compute_instance_id 0-7")
        uuid = m.uuid or derived_uuid("MIG", node_name, preset_key, "gpu", index, "mig", j)
        if not uuid.startswith("MIG-"):
            raise ConfigError(f"{where}.mig[{j}].uuid: MIG UUIDs start with 'MIG-', got {uuid!r}")
        profile = profiles[j]
        gb = _PROFILE.fullmatch(m.profile)
        fallback = profile.memory_mib if profile is not None else int(gb.group(2)) * 1024 if gb else 0
        gi_minor, ci_minor = cap_minors(minor, gi, ci)
        out.append(
            MigDevice(
                uuid=uuid,
                parent_uuid=parent,
                index=j,
                gpu_instance_id=gi,
                compute_instance_id=ci,
                profile=m.profile,
                memory_mib=m.memory_mib or spec.mig_profiles.get(m.profile, fallback),
                gi_cap_minor=gi_minor,
                ci_cap_minor=ci_minor,
                profile_id=profile.profile_id if profile is not None else None,
                placement=placement,
            )
        )
    pairs = [(m.gpu_instance_id, m.compute_instance_id) for m in out]
    if len(set(pairs)) != len(pairs):
        raise ConfigError(f"{where}.mig: two MIG devices share a GPU instance and compute instance id")
    return tuple(out)


def _place(
    migs: tuple[MigSpec, ...], options: list[tuple[MigPlacement, ...]], slices: int, where: str
) -> list[MigPlacement | None]:
    """Placements: explicit GPU instance ids where they name one, the rest fitted largest first."""
    placed: list[MigPlacement | None] = [None] * len(migs)
    used = 0
    for j, m in enumerate(migs):
        if m.gpu_instance_id is not None and options[j]:
            explicit = placement_of(m.gpu_instance_id, slices, options[j][0].size)
            placed[j] = explicit if explicit in options[j] else None
            used |= _mask(explicit) if explicit in options[j] else 0
    auto = sorted((j for j, m in enumerate(migs) if m.gpu_instance_id is None), key=lambda j: -options[j][0].size)

    def fit(k: int, used: int) -> bool:  # depth-first over placements; at most 8 devices
        if k == len(auto):
            return True
        j = auto[k]
        for placement in options[j]:
            mask = _mask(placement)
            if not used & mask and fit(k + 1, used | mask):
                placed[j] = placement
                return True
        return False

    if not fit(0, used):
        profiles = ", ".join(migs[j].profile for j in auto)
        raise ConfigError(f"{where}.mig: {profiles} do not fit on one GPU ({slices} memory slices)")
    return placed


def _mask(placement: MigPlacement | None) -> int:
    return 0 if placement is None else ((1 << placement.size) - 1) << placement.start


def _check_unique(gpus: tuple[Gpu, ...]) -> None:
    for what in ("index", "minor", "uuid", "pci_bus_id"):
        seen: set[object] = set()
        for i, gpu in enumerate(gpus):
            value = getattr(gpu, what)
            if value in seen:
                raise ConfigError(f"gpus[{i}].{what}: {value!r} is used by another GPU")
            seen.add(value)
    mig_uuids = [m.uuid for gpu in gpus for m in gpu.mig_devices]
    if len(set(mig_uuids)) != len(mig_uuids):
        raise ConfigError("gpus: two MIG devices have the same uuid")


def _build_links(topology: TopologySpec, gpus: tuple[Gpu, ...]) -> dict[tuple[str, str], Link]:
    if topology.nvlinks < 0:
        raise ConfigError(f"topology.nvlinks: must not be negative, got {topology.nvlinks}")
    links: dict[tuple[str, str], Link] = {}
    for i, a in enumerate(gpus):
        for b in gpus[i + 1 :]:
            same_numa = a.numa_node is not None and a.numa_node == b.numa_node
            pcie = topology.pcie_same_numa if same_numa and topology.pcie_same_numa else topology.pcie
            links[link_key(a.uuid, b.uuid)] = Link(nvlinks=topology.nvlinks, pcie=PcieLevel[pcie.upper()])
    by_index = {gpu.index: gpu for gpu in gpus}
    for p, pair in enumerate(topology.pairs):
        where = f"topology.pairs[{p}]"
        if len(pair.gpus) != 2 or pair.gpus[0] == pair.gpus[1]:
            raise ConfigError(f"{where}.gpus: name two different GPU indexes, got {list(pair.gpus)}")
        missing = [i for i in pair.gpus if i not in by_index]
        if missing:
            raise ConfigError(f"{where}.gpus: no GPU with index {missing[0]}")
        if pair.nvlinks is not None and pair.nvlinks < 0:
            raise ConfigError(f"{where}.nvlinks: must not be negative, got {pair.nvlinks}")
        key = link_key(by_index[pair.gpus[0]].uuid, by_index[pair.gpus[1]].uuid)
        old = links[key]
        links[key] = Link(
            nvlinks=old.nvlinks if pair.nvlinks is None else pair.nvlinks,
            pcie=old.pcie if pair.pcie is None else PcieLevel[pair.pcie.upper()],
        )
    return links


# --- the backend ------------------------------------------------------------------------
