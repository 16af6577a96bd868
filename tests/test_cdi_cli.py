"""``gpu-agent cdi generate`` and ``gpu-agent cdi check``."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent.cdi import spec as s
from agent.cdi.errors import CdiError
from agent.cli import cdi as cli
from agent.core.config.schema import Config
from agent.core.inventory.model import Inventory
from tests.cdi_fixtures import FakeDriver, inventory

runner = CliRunner()


def test_render_device_plugin_spec(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    text = cli.render_device_plugin_spec(inventory(2), driver_root=driver.root, hook_candidates=[])
    spec = s.loads(text)
    assert s.validate(spec) == [] and spec.version == s.minimum_version(spec)
    assert spec.kind == "k8s.gpu-node-agent.nvidia.com/gpu"
    with pytest.raises(CdiError, match="no GPUs"):
        cli.render_device_plugin_spec(inventory(0), driver_root=driver.root)


@pytest.fixture
def fake_backend(monkeypatch: pytest.MonkeyPatch) -> list[Config]:
    seen: list[Config] = []

    async def load(config: Config) -> Inventory:
        seen.append(config)
        return inventory(2)

    monkeypatch.setattr(cli, "_load_inventory", load)
    return seen


def test_generate_command_writes_a_file(tmp_path: Path, fake_backend: list[Config]) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    out = tmp_path / "spec.json"
    result = runner.invoke(
        cli.cdi_app, ["generate", "--driver-root", str(driver.root), "--output", str(out), "--simulated"]
    )
    assert result.exit_code == 0, result.output
    assert s.validate(s.loads(out.read_text())) == []
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert fake_backend[0].backend == "simulated" and fake_backend[0].paths.driver_root == driver.root


def test_generate_command_to_stdout(tmp_path: Path, fake_backend: list[Config]) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    result = runner.invoke(cli.cdi_app, ["generate", "--driver-root", str(driver.root)])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["cdiVersion"] == "0.5.0"


def test_generate_command_reports_a_bad_driver_root(tmp_path: Path, fake_backend: list[Config]) -> None:
    result = runner.invoke(cli.cdi_app, ["generate", "--driver-root", str(tmp_path / "missing")])
    assert result.exit_code == 1
    assert f"error: driver root {tmp_path / 'missing'} does not exist" in result.output


def test_check_accepts_a_valid_directory(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    (cdi / "k8s.gpu-node-agent.nvidia.com-gpu.json").write_text(
        cli.render_device_plugin_spec(inventory(2), driver_root=driver.root, hook_candidates=[])
    )
    (cdi / "vendor.yaml").write_text(
        "cdiVersion: 0.3.0\nkind: vendor.com/x\ndevices:\n- name: a\n  containerEdits:\n    env: [A=1]\n"
    )
    (cdi / "notes.txt").write_text("ignored, like the runtime does")
    result = runner.invoke(cli.cdi_app, ["check", str(cdi)])
    assert result.exit_code == 0, result.output
    assert "ok: 2 spec files, 6 devices" in result.output


def test_check_reports_every_problem_one_per_line(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    dev = {"name": "gpu0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}
    (cdi / "a.json").write_text(json.dumps({"cdiVersion": "0.3.0", "kind": "v.com/gpu", "devices": [dev]}))
    (cdi / "b.json").write_text(json.dumps({"cdiVersion": "0.3.0", "kind": "v.com/gpu", "devices": [dev]}))
    (cdi / "c.json").write_text(json.dumps({"cdiVersion": "0.3.0", "kind": "v.com/gpu", "devices": [dev], "x": 1}))
    low = {"name": "0", "containerEdits": {"env": ["A=1"]}}
    (cdi / "d.json").write_text(json.dumps({"cdiVersion": "0.4.0", "kind": "w.com/gpu", "devices": [low]}))
    result = runner.invoke(cli.cdi_app, ["check", str(cdi)])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 3, lines
    assert any("conflict: v.com/gpu=gpu0 is defined in a.json, b.json" in line for line in lines)
    assert any(line.startswith(str(cdi / "c.json")) and "unknown field 'x'" in line for line in lines)
    assert any(line.startswith(str(cdi / "d.json")) and "at least v0.5.0" in line for line in lines)


def test_check_missing_directory_is_one_line_on_stderr(tmp_path: Path) -> None:
    result = runner.invoke(cli.cdi_app, ["check", str(tmp_path / "nope")])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr == f"gpu-agent: error: cannot check {tmp_path / 'nope'}: not a directory\n"


def test_generate_command_names_host_paths(tmp_path: Path, fake_backend: list[Config]) -> None:
    driver = FakeDriver(tmp_path / "driver-root").build()
    host_root = tmp_path / "host" / "run" / "nvidia" / "driver"  # where the runtime would see it; not here
    args = ["generate", "--driver-root", str(driver.root), "--host-driver-root", str(host_root), "--simulated"]
    result = runner.invoke(cli.cdi_app, args)
    assert result.exit_code == 0, result.output
    spec = s.loads(result.stdout)
    assert s.validate(spec) == []
    edits = [spec.container_edits, *(d.container_edits for d in spec.devices)]
    paths = [n.host_path or n.path for e in edits for n in e.device_nodes]
    paths += [m.host_path for e in edits for m in e.mounts]
    assert paths and all(p.startswith(f"{host_root}/") for p in paths), paths
    assert fake_backend[0].paths.host_driver_root == host_root


def test_generate_command_rejects_a_relative_host_driver_root(tmp_path: Path, fake_backend: list[Config]) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    result = runner.invoke(cli.cdi_app, ["generate", "--driver-root", str(driver.root), "--host-driver-root", "run"])
    assert result.exit_code == 2  # a bad flag
    assert "gpu-agent: error: paths.host_driver_root: must be an absolute path" in result.output
