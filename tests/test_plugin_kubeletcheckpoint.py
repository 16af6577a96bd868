"""The GPUs the kubelet's own checkpoint says the plugin listed last (healthy), by any device ID form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.core.config.schema import PluginConfig, TimeSlicingConfig
from agent.deviceplugin.kubeletcheckpoint import CHECKPOINT, listed_gpus
from agent.deviceplugin.resources import plan_resources
from tests.test_plugin_resources import inventory


async def test_the_kubelets_registered_devices_name_our_gpus(tmp_path: Path) -> None:
    inv = await inventory("h100-8x-nvlink")
    g = {i: inv.find(str(i)).uuid for i in range(8)}  # type: ignore[union-attr]
    plan = {r.name: r for r in plan_resources(inv, PluginConfig(time_slicing=TimeSlicingConfig(replicas=2))).resources}
    path = tmp_path / CHECKPOINT
    registered = {
        "nvidia.com/gpu": [f"{g[0]}::0", f"{g[0]}::1", f"{g[3]}::1", "GPU-not-here::0"],
        "example.com/fpga": [g[5]],  # not ours
    }
    path.write_text(json.dumps({"Data": {"PodDeviceEntries": None, "RegisteredDevices": registered}, "Checksum": 1}))
    assert listed_gpus(path, plan=plan, inventory=inv, own_names=plan) == {g[0], g[3]}


UNREADABLE = [None, "", "{", '{"Data": []}', '{"Data": {"RegisteredDevices": {"nvidia.com/gpu": 3}}}']


@pytest.mark.parametrize("content", UNREADABLE)
async def test_a_checkpoint_that_cannot_be_read_lists_nothing(tmp_path: Path, content: str | None) -> None:
    inv = await inventory("h100-8x-nvlink")
    plan = {r.name: r for r in plan_resources(inv, PluginConfig()).resources}
    path = tmp_path / CHECKPOINT
    if content is not None:
        path.write_text(content)
    assert listed_gpus(path, plan=plan, inventory=inv, own_names=plan) == frozenset()
