"""MIG profile tables (agent/backends/migprofiles.py) and the presets' MIG models."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.backends.migprofiles import (
    A30_24GB,
    MODELS,
    MigModel,
    cap_minors,
    gpu_instance_id,
    placement_of,
    toggles_without_reset,
)
from agent.backends.simulated import SimulatedBackend
from agent.base.errors import ConfigError
from agent.core.config.schema import HealthConfig
from agent.core.inventory.model import MigPlacement
from agent.core.inventory.render import inventory_json, inventory_table

NAME = re.compile(r"^(\d+)g\.(\d+)gb(\+me)?$")


@pytest.mark.parametrize("model", MODELS.values(), ids=lambda m: m.key)
def test_every_table_is_consistent(model: MigModel) -> None:
    assert len({p.profile_id for p in model.profiles}) == len(model.profiles)
    assert len({p.name for p in model.profiles}) == len(model.profiles)
    for p in model.profiles:
        match = NAME.fullmatch(p.name)
        assert match is not None and int(match.group(1)) == p.compute_slices, p.name
        assert p.placements and all(pl.size == p.memory_slices for pl in p.placements), p.name
        assert all(pl.start >= 0 and pl.start + pl.size <= model.memory_slices for pl in p.placements), p.name
        assert p.compute_slices <= model.compute_slices and p.memory_mib > 0 and p.multiprocessors > 0
        if match.group(3):  # "+me": one instance, anywhere a plain one may sit
            assert p.max_instances == 1
        else:
            assert p.max_instances == len(p.placements), p.name
    full = [p for p in model.profiles if p.memory_slices == model.memory_slices]
    assert len(full) == 1 and full[0].compute_slices == model.compute_slices


def test_h100_table_matches_nvidia_smi() -> None:
    """``nvidia-smi mig -lgipp`` on an H100 80GB: ID 19 {0..6}:1, 15 {0,2,4,6}:2, 14 {0,2,4}:2,
    9 {0,4}:4, 5 {0}:4, 0 {0}:8."""
    h100 = MODELS["h100-80gb"]
    placements = {p.profile_id: ({pl.start for pl in p.placements}, p.memory_slices) for p in h100.profiles}
    assert placements == {
        19: ({0, 1, 2, 3, 4, 5, 6}, 1),
        20: ({0, 1, 2, 3, 4, 5, 6}, 1),
        15: ({0, 2, 4, 6}, 2),
        14: ({0, 2, 4}, 2),
        9: ({0, 4}, 4),
        5: ({0}, 4),
        0: ({0}, 8),
    }
    assert [p.name for p in h100.profiles] == [
        "1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"
    ]  # fmt: skip
    assert not MODELS["h200-141gb"].verified and MODELS["h100-80gb"].verified


@pytest.mark.parametrize(
    ("placement", "slices", "gi"),
    [
        (MigPlacement(0, 8), 8, 0),  # 7g
        (MigPlacement(0, 4), 8, 1),  # 4g / 3g at 0
        (MigPlacement(4, 4), 8, 2),  # 3g at 4
        (MigPlacement(4, 2), 8, 5),  # 2g at 4
        (MigPlacement(6, 2), 8, 6),  # 1g.20gb at 6
        (MigPlacement(0, 1), 8, 7),  # 1g at 0
        (MigPlacement(6, 1), 8, 13),  # 1g at 6
        (MigPlacement(0, 4), 4, 0),  # A30 4g
        (MigPlacement(2, 2), 4, 2),  # A30 2g at 2
        (MigPlacement(3, 1), 4, 6),  # A30 1g at 3
        (MigPlacement(1, 2), 8, None),  # off the tree
        (MigPlacement(7, 2), 8, None),  # past the end
    ],
)
def test_gpu_instance_ids_follow_the_placement(placement: MigPlacement, slices: int, gi: int | None) -> None:
    assert gpu_instance_id(placement, slices) == gi
    if gi is not None:
        assert placement_of(gi, slices, placement.size) == placement


def test_every_placement_has_its_own_gpu_instance_id() -> None:
    for model in MODELS.values():
        ids: dict[int, MigPlacement] = {}
        for p in model.profiles:
            for pl in p.placements:
                gi = gpu_instance_id(pl, model.memory_slices)
                assert gi is not None and 0 <= gi <= 14
                assert ids.setdefault(gi, pl) == pl  # one id, one placement
    assert gpu_instance_id(A30_24GB.profiles[0].placements[3], 4) == 6


def test_capability_minors_as_the_mig_user_guide_lists_them() -> None:
    """GPU 0, GPU instance 1, compute instances 0-2: nvidia-cap12, -cap13, -cap14, -cap15."""
    assert [cap_minors(0, 1, ci) for ci in range(3)] == [(12, 13), (12, 14), (12, 15)]
    assert cap_minors(3, 3, 3)[1] == 439 and cap_minors(6, 11, 5)[1] == 918


def test_only_hopper_and_later_toggle_without_reset() -> None:
    assert toggles_without_reset("hopper") and toggles_without_reset("blackwell")
    assert not toggles_without_reset("ampere") and not toggles_without_reset("ada")


# --- presets ------------------------------------------------------------------------------

FAST = HealthConfig(check_interval_s=0.005)


def make(preset: str) -> SimulatedBackend:
    return SimulatedBackend(preset=preset, node_name="node-a", health=FAST)


async def test_default_preset_gpus_are_mig_capable_h100s_in_whole_gpu_mode() -> None:
    inventory = await make("h100-8x-nvlink").load()
    for gpu in inventory:
        assert gpu.mig_memory_slices == 8 and not gpu.mig_enabled and gpu.mig_devices == ()
        assert gpu.mig_profiles == MODELS["h100-80gb"].profiles
    # what a user sees as text does not change
    assert "MIG" in inventory_table(inventory) and "off" in inventory_table(inventory)
    assert inventory_json(inventory)["gpus"][0]["mig_profiles"][0]["placements"][:2] == ["0:1", "1:1"]


async def test_a100_preset_devices_know_their_profile_and_placement() -> None:
    inventory = await make("a100-4x-mig").load()
    second = inventory.gpus[1]  # 3g.20gb + 2g.10gb + 1g.5gb + 1g.5gb
    assert [(m.profile, m.profile_id, m.placement) for m in second.mig_devices] == [
        ("3g.20gb", 9, MigPlacement(4, 4)),
        ("2g.10gb", 14, MigPlacement(0, 2)),
        ("1g.5gb", 19, MigPlacement(2, 1)),
        ("1g.5gb", 19, MigPlacement(3, 1)),
    ]
    # the preset's memory figures are the GPU's profile table's too
    table = {p.name: p.memory_mib for p in second.mig_profiles}
    assert table["3g.20gb"] == 20096 == second.mig_devices[0].memory_mib
    assert inventory_json(inventory)["gpus"][1]["mig_devices"][0]["placement"] == "4:4"


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "node.yaml"
    path.write_text(
        "defaults: {memory_mib: 81559, product_name: x, architecture: hopper, compute_capability: '9.0'}\n" + text
    )
    return str(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("gpus: [{mig_model: b300}]", "gpus[0].mig_model: expected one of a100-40gb"),
        ("gpus: [{mig_model: h100-80gb, mig: [1g.5gb]}]", "'1g.5gb' is not a profile of this GPU (known: 1g.10gb"),
        ("gpus: [{mig_model: a30-24gb, mig: [4g.24gb, 1g.6gb]}]", "4g.24gb, 1g.6gb do not fit on one GPU (4 memory"),
        ("gpus: [{mig: [1g.5gb, 1g.5gb, 1g.5gb, 1g.5gb, 1g.5gb, 1g.5gb, 1g.5gb, 1g.5gb, 1g.5gb]}]", "at most 8"),
    ],
)
def test_bad_mig_models(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        make(write(tmp_path, text))
    assert expected in str(info.value) and "\n" not in str(info.value)


async def test_explicit_gpu_instances_are_placed_first(tmp_path: Path) -> None:
    """A listed GPU instance id takes its slices; automatic placement fits around it."""
    text = "gpus: [{mig_model: h100-80gb, mig: [3g.40gb, {profile: 3g.40gb, gpu_instance_id: 1}]}]"
    gpu = (await make(write(tmp_path, text)).load()).gpus[0]
    assert [(m.gpu_instance_id, m.placement) for m in gpu.mig_devices] == [
        (2, MigPlacement(4, 4)),
        (1, MigPlacement(0, 4)),
    ]
