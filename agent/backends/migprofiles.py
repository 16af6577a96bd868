"""MIG GPU-instance profiles of the MIG-capable models, as data, and MIG's placement geometry.

The simulated backend gives its GPUs these tables (a preset names one with ``mig_model``); the
NVML backend reads the real ones from the driver and never uses them. Sources:

* profile names, memory and SM fractions, media engines, copy engines and instance counts:
  NVIDIA's MIG user guide, "Supported MIG Profiles"
  (https://docs.nvidia.com/datacenter/tesla/mig-user-guide/supported-mig-profiles.html,
  tables "GPU Instance Profiles on A100", "... on H100", "... on H200" and the A30 table);
* profile IDs and placements: ``nvidia-smi mig -lgipp`` as the guide prints it for an
  A100-SXM4-40GB ("Getting Started with MIG",
  https://docs.nvidia.com/datacenter/tesla/mig-user-guide/getting-started-with-mig.html):
  ID 19 ``{0,1,2,3,4,5,6}:1``, 20 ``{0..6}:1``, 15 ``{0,2,4,6}:2``, 14 ``{0,2,4}:2``,
  9 ``{0,4}:4``, 5 ``{0}:4``, 0 ``{0}:8``; H100 80GB lists the same IDs and placements;
* memory in MiB and SM counts: what ``nvidia-smi mig -lgip`` reports on each model. They vary by
  a few hundred MiB with the driver and the SKU; on a real node NVML's ``memorySizeMB`` is the
  truth.

The H200 table is partly inferred: its names, fractions, engines and instance counts are the
guide's, but its profile IDs and start positions are taken from the H100 pattern (the guide's
fractions are identical) and its memory and SM figures are estimates. Each model says so in
``verified``.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.core.inventory.model import MigPlacement, MigProfile

#: architectures (``Gpu.architecture``) whose MIG mode changes without a GPU reset: "Starting
#: with the NVIDIA Hopper architecture, enabling MIG mode no longer requires a GPU reset"
#: (MIG user guide, "Getting Started with MIG", "GPU Reset on Hopper+ GPUs"); Ampere needs one
TOGGLE_WITHOUT_RESET = frozenset({"hopper", "blackwell", "rubin"})


def toggles_without_reset(architecture: str) -> bool:
    """Whether the GPU's MIG mode can be switched while the driver keeps running (Hopper and later)."""
    return architecture in TOGGLE_WITHOUT_RESET


@dataclass(frozen=True, slots=True)
class MigModel:
    """The MIG geometry of one GPU model: its slices and every GPU-instance profile it offers."""

    key: str
    memory_slices: int
    compute_slices: int
    profiles: tuple[MigProfile, ...]
    #: False where some figures are inferred rather than seen on the hardware (see ``note``)
    verified: bool = True
    note: str = ""

    def profile(self, name: str) -> MigProfile | None:
        return next((p for p in self.profiles if p.name == name), None)


def _starts(*starts: int, size: int) -> tuple[MigPlacement, ...]:
    """Placements in ``nvidia-smi mig -lgipp`` notation: ``{starts}:size``."""
    return tuple(MigPlacement(start=s, size=size) for s in starts)


_P1 = _starts(0, 1, 2, 3, 4, 5, 6, size=1)
_P1_WIDE = _starts(0, 2, 4, 6, size=2)  # one compute slice over two memory slices
_P2 = _starts(0, 2, 4, size=2)
_P3 = _starts(0, 4, size=4)
_P4 = _starts(0, size=4)
_P7 = _starts(0, size=8)


def _profile(
    name: str,
    profile_id: int,
    compute: int,
    placements: tuple[MigPlacement, ...],
    memory_mib: int,
    sms: int,
    count: int,
    copy: int,
    engines: tuple[int, int, int],
) -> MigProfile:
    """A profile; ``engines`` is (NVDEC, JPEG, OFA) as the guide's "Hardware Units" column lists them."""
    decoders, jpeg, ofa = engines
    return MigProfile(
        name=name,
        profile_id=profile_id,
        compute_slices=compute,
        memory_slices=placements[0].size,
        memory_mib=memory_mib,
        multiprocessors=sms,
        max_instances=count,
        placements=placements,
        copy_engines=copy,
        decoders=decoders,
        jpeg_engines=jpeg,
        ofa_engines=ofa,
    )


A100_40GB = MigModel(
    key="a100-40gb",
    memory_slices=8,
    compute_slices=7,
    profiles=(
        _profile("1g.5gb", 19, 1, _P1, 4864, 14, 7, 1, (0, 0, 0)),
        _profile("1g.5gb+me", 20, 1, _P1, 4864, 14, 1, 1, (1, 1, 1)),
        _profile("1g.10gb", 15, 1, _P1_WIDE, 9856, 14, 4, 1, (1, 0, 0)),
        _profile("2g.10gb", 14, 2, _P2, 9856, 28, 3, 2, (1, 0, 0)),
        _profile("3g.20gb", 9, 3, _P3, 19968, 42, 2, 3, (2, 0, 0)),
        _profile("4g.20gb", 5, 4, _P4, 19968, 56, 1, 4, (2, 0, 0)),
        _profile("7g.40gb", 0, 7, _P7, 40192, 98, 1, 7, (5, 1, 1)),
    ),
)

#: "For A100-SXM4-80GB, the profile names will change according to the memory proportion"; IDs,
#: placements, SMs and engines are the A100 40GB's
A100_80GB = MigModel(
    key="a100-80gb",
    memory_slices=8,
    compute_slices=7,
    profiles=(
        _profile("1g.10gb", 19, 1, _P1, 9728, 14, 7, 1, (0, 0, 0)),
        _profile("1g.10gb+me", 20, 1, _P1, 9728, 14, 1, 1, (1, 1, 1)),
        _profile("1g.20gb", 15, 1, _P1_WIDE, 19968, 14, 4, 1, (1, 0, 0)),
        _profile("2g.20gb", 14, 2, _P2, 19968, 28, 3, 2, (1, 0, 0)),
        _profile("3g.40gb", 9, 3, _P3, 40192, 42, 2, 3, (2, 0, 0)),
        _profile("4g.40gb", 5, 4, _P4, 40192, 56, 1, 4, (2, 0, 0)),
        _profile("7g.80gb", 0, 7, _P7, 80896, 98, 1, 7, (5, 1, 1)),
    ),
)

H100_80GB = MigModel(
    key="h100-80gb",
    memory_slices=8,
    compute_slices=7,
    profiles=(
        _profile("1g.10gb", 19, 1, _P1, 9984, 16, 7, 1, (1, 1, 0)),
        _profile("1g.10gb+me", 20, 1, _P1, 9984, 16, 1, 1, (1, 1, 1)),
        _profile("1g.20gb", 15, 1, _P1_WIDE, 20096, 26, 4, 1, (1, 1, 0)),
        _profile("2g.20gb", 14, 2, _P2, 20096, 32, 3, 2, (2, 2, 0)),
        _profile("3g.40gb", 9, 3, _P3, 40448, 60, 2, 3, (3, 3, 0)),
        _profile("4g.40gb", 5, 4, _P4, 40448, 64, 1, 4, (4, 4, 0)),
        _profile("7g.80gb", 0, 7, _P7, 81152, 132, 1, 8, (7, 7, 1)),
    ),
)

H200_141GB = MigModel(
    key="h200-141gb",
    memory_slices=8,
    compute_slices=7,
    profiles=(
        _profile("1g.18gb", 19, 1, _P1, 16384, 16, 7, 1, (1, 1, 0)),
        _profile("1g.18gb+me", 20, 1, _P1, 16384, 16, 1, 1, (1, 1, 1)),
        _profile("1g.35gb", 15, 1, _P1_WIDE, 33280, 26, 4, 1, (1, 1, 0)),
        _profile("2g.35gb", 14, 2, _P2, 33280, 32, 3, 2, (2, 2, 0)),
        _profile("3g.71gb", 9, 3, _P3, 66560, 60, 2, 3, (3, 3, 0)),
        _profile("4g.71gb", 5, 4, _P4, 66560, 64, 1, 4, (4, 4, 0)),
        _profile("7g.141gb", 0, 7, _P7, 143360, 132, 1, 8, (7, 7, 1)),
    ),
    verified=False,
    note="profile IDs and start positions follow the H100 pattern; memory and SM figures are estimates",
)

#: 4 memory and 4 compute slices; the +me profiles need R470 (1g) and R525 (2g) drivers
A30_24GB = MigModel(
    key="a30-24gb",
    memory_slices=4,
    compute_slices=4,
    profiles=(
        _profile("1g.6gb", 14, 1, _starts(0, 1, 2, 3, size=1), 5949, 14, 4, 1, (0, 0, 0)),
        _profile("1g.6gb+me", 21, 1, _starts(0, 1, 2, 3, size=1), 5949, 14, 1, 1, (1, 1, 1)),
        _profile("2g.12gb", 5, 2, _starts(0, 2, size=2), 11971, 28, 2, 2, (2, 0, 0)),
        _profile("2g.12gb+me", 6, 2, _starts(0, 2, size=2), 11971, 28, 1, 2, (2, 1, 1)),
        _profile("4g.24gb", 0, 4, _starts(0, size=4), 24064, 56, 1, 4, (4, 1, 1)),
    ),
)

MODELS: dict[str, MigModel] = {m.key: m for m in (A100_40GB, A100_80GB, H100_80GB, H200_141GB, A30_24GB)}


def media_extended(profile: MigProfile) -> bool:
    """A "+me" profile: "A single 1g profile can include media extensions" (one per GPU)."""
    return profile.name.endswith("+me")


# --- GPU instance IDs ---------------------------------------------------------------------
# The driver numbers GPU instances by where they sit, as a binary tree over the memory slices:
# the whole GPU is 0, the halves 1-2, the quarters 3-6, the eighths 7-14 (on an A30's four
# slices: 0, 1-2, 3-6). ``nvidia-smi mig -lgi`` listings in the MIG user guide show exactly this
# (a 1g.5gb at placement 6:1 is GPU instance 13, a 3g.20gb at 4:4 is 2, a 7g.40gb is 0).


def gpu_instance_id(placement: MigPlacement, memory_slices: int) -> int | None:
    """The GPU instance ID of an instance at ``placement``; None for a placement off the tree."""
    size, start = placement.size, placement.start
    if size <= 0 or memory_slices % size or start % size or start + size > memory_slices:
        return None
    return memory_slices // size - 1 + start // size


def placement_of(gpu_instance: int, memory_slices: int, size: int) -> MigPlacement | None:
    """The inverse of :func:`gpu_instance_id` for an instance ``size`` memory slices wide."""
    if size <= 0 or memory_slices % size:
        return None
    first = memory_slices // size - 1
    start = (gpu_instance - first) * size
    if not 0 <= start <= memory_slices - size:
        return None
    return MigPlacement(start=start, size=size)


# --- capability minors ----------------------------------------------------------------------
# ``/proc/driver/nvidia-caps/mig-minors`` numbers every possible GPU and compute instance in
# advance: "config 1", "monitor 2", then per GPU minor G, per GPU instance I (0-14) an access
# minor followed by one per compute instance C (0-7). The MIG user guide's "Device Nodes and
# Capabilities" example (GPU 0, GPU instance 1, compute instances 0-2: nvidia-cap12 to -cap15)
# fits ``3 + 135 G + 9 I`` and ``+ 1 + C``. The NVML backend reads the file; the simulated
# backend computes it.
_CAPS_FIRST = 3
_CAPS_PER_GI = 9
_CAPS_PER_GPU = 15 * _CAPS_PER_GI


def cap_minors(gpu_minor: int, gpu_instance: int, compute_instance: int) -> tuple[int, int]:
    """(GPU-instance access minor, compute-instance access minor) under ``/dev/nvidia-caps``."""
    gi = _CAPS_FIRST + gpu_minor * _CAPS_PER_GPU + gpu_instance * _CAPS_PER_GI
    return gi, gi + 1 + compute_instance
