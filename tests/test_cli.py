from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent import __version__
from agent.cli import app
from tests.agentproc import run_cli

runner = CliRunner()


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args), env={"LD_LIBRARY_PATH": "/nonexistent"})
    return result.exit_code, result.stdout, result.stderr


def test_version() -> None:
    code, out, _ = invoke("version")
    assert code == 0 and out.startswith(f"gpu-agent {__version__}")


def test_python_dash_m_agent_is_the_same_command() -> None:
    result = run_cli("version")
    assert result.returncode == 0 and __version__ in result.stdout


def test_inventory_json_on_a_preset() -> None:
    code, out, _ = invoke("inventory", "--json", "--simulated", "--preset", "a100-4x-mig", "--node-name", "n1")
    assert code == 0
    doc = json.loads(out)
    assert doc["backend"] == "simulated" and len(doc["gpus"]) == 4
    assert all(g["mig_enabled"] for g in doc["gpus"])
    assert doc["topology"]["0-1"] == "NV12"
    # deterministic per node name
    again = json.loads(invoke("inventory", "--json", "--simulated", "--preset", "a100-4x-mig", "--node-name", "n1")[1])
    assert [g["uuid"] for g in again["gpus"]] == [g["uuid"] for g in doc["gpus"]]


def test_inventory_table() -> None:
    code, out, _ = invoke("inventory", "--simulated")
    assert code == 0
    assert "NVIDIA H100 80GB HBM3" in out and "NV18" in out and "topology:" in out


def test_inventory_without_gpus_and_explicit_nvml() -> None:
    code, out, _ = invoke("inventory")
    assert code == 0 and "no GPUs on this node" in out
    code, _, err = invoke("inventory", "--backend", "nvml")
    assert code == 1
    assert err.startswith("gpu-agent: error:") and "NVML" in err and len(err.strip().splitlines()) == 1


CONFIG = """
ownership:
  default: device-plugin
  nodes:
    - match: {labels: {pool: dra}}
      default: dra
      gpus: {"0": device-plugin}
"""


def test_config_check_prints_effective_ownership(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG)
    code, out, _ = invoke("config", "check", str(path), "--node-name", "n1", "--label", "pool=dra", "--simulated")
    assert code == 0, out
    assert "valid" in out and "matched ownership.nodes[0]; default owner: dra" in out
    lines = [line.split() for line in out.splitlines() if line.startswith("    ")]
    assert [owner for _, _, owner in lines] == ["device-plugin"] + ["dra"] * 7
    code, out, _ = invoke("config", "check", str(path), "--node-name", "n1")
    assert code == 0 and "cluster default owner: device-plugin" in out


def test_config_check_warns_about_inert_overrides(tmp_path: Path) -> None:
    """An override naming no GPU of the node is inert (a GPU off the bus), shown but not an error."""
    path = tmp_path / "c.yaml"
    path.write_text("ownership:\n  nodes: [{match: {names: [n1]}, gpus: {GPU-nope: dra}}]\n")
    code, out, _ = invoke("config", "check", str(path), "--node-name", "n1", "--simulated")
    assert code == 0, out
    assert "warning: ownership.nodes[0].gpus['GPU-nope']: no GPU with that UUID or index on node 'n1'" in out


@pytest.mark.parametrize(
    ("text", "args", "message"),
    [
        ("ownership: {default: gpu}\n", [], "ownership.default: expected one of"),
        ("{}\n", ["--label", "novalue"], "--label: expected KEY=VALUE"),
        ("plugin: {time_slicing: {replicas: '²'}}\n", [], "plugin.time_slicing.replicas: expected an integer"),
        ("node_labels: &x {a: *x}\n", [], "self-referencing YAML aliases"),
    ],
)
def test_config_check_errors_are_one_line(tmp_path: Path, text: str, args: list[str], message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    code, _, err = invoke("config", "check", str(path), *args)
    assert code == 2
    assert err.strip().splitlines() == [err.strip()] and message in err


def test_config_check_missing_file(tmp_path: Path) -> None:
    code, _, err = invoke("config", "check", str(tmp_path / "nope.yaml"))
    assert code == 2 and "cannot read config file" in err


async def test_a_signal_during_start_up_unwinds_it_and_exits_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import os
    import signal

    import agent.app
    from agent.cli import _run

    unwound = asyncio.Event()
    starting = asyncio.Event()

    async def slow_start(options: object, *, stop: asyncio.Event, on_agent: object = None) -> None:
        try:
            starting.set()
            await asyncio.Event().wait()  # e.g. NVML initialising on a sick node
        finally:
            unwound.set()

    monkeypatch.setattr(agent.app, "run_agent", slow_start)
    task = asyncio.create_task(_run(object()))
    await asyncio.wait_for(starting.wait(), 5)
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(task, 5) == 0
    assert unwound.is_set()
