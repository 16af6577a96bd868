"""The shipped node configs stay valid and say what their comments say: the example fleet
(config/example-config.yaml, the per-node mode switch) passes ``gpu-agent config check`` for
each kind of node it describes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent.cli.main import app
from agent.core.config.loader import build_config, read_document
from agent.core.config.schema import Owner

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "config" / "example-config.yaml"


def test_example_config_is_valid() -> None:
    config = build_config(read_document(EXAMPLE))
    assert [rule.default for rule in config.ownership.nodes] == [Owner.DEVICE_PLUGIN, Owner.DRA, Owner.DEVICE_PLUGIN]
    assert config.plugin.device_list_strategy == ("cdi-cri", "envvar")


def _check(*args: str) -> list[tuple[str, str]]:
    result = CliRunner().invoke(app, ["config", "check", str(EXAMPLE), "--simulated", *args])
    assert result.exit_code == 0, result.output
    assert f"{EXAMPLE}: valid" in result.output
    # "  <index>  GPU-<uuid>  <owner>  <DRA publish mode>" per GPU of the simulated 8-GPU node
    return re.findall(r"^\s+\d+\s+GPU-\S+\s+(\S+)\s+(\S+)$", result.output, re.M)


def _owners(*args: str) -> list[str]:
    return [owner for owner, _ in _check(*args)]


@pytest.mark.parametrize(
    ("args", "owners"),
    [
        (["--node-name", "gpu-node-7", "--label", "gpu-pool=dra"], ["dra"] * 4 + ["device-plugin"] * 3 + ["none"]),
        (["--node-name", "a100-dra-3", "--label", "gpu-pool=dra"], ["dra"] * 8),
        (["--node-name", "h100-train-1", "--label", "gpu-pool=training"], ["device-plugin"] * 8),
        (["--node-name", "unlabelled-1"], ["device-plugin"] * 8),
    ],
    ids=["split-node", "dra-pool", "device-plugin-pool", "unmatched"],
)
def test_example_fleet_ownership(args: list[str], owners: list[str]) -> None:
    assert _owners(*args) == owners


def test_example_fleet_publish_modes() -> None:
    """The DRA pool carves its GPUs and shares GPU 7; elsewhere DRA GPUs are whole."""
    assert [mode for _, mode in _check("--node-name", "a100-dra-3", "--label", "gpu-pool=dra")] == [
        "dynamic-mig"
    ] * 7 + ["shared"]
    assert {mode for _, mode in _check("--node-name", "unlabelled-1")} == {"whole"}
