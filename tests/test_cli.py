from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent import __version__
from agent.cli.main import app
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


@pytest.mark.parametrize(
    "command",
    [["inventory"], ["config", "plan", "CONFIG", "--debug-addr", "127.0.0.1:1"], ["cdi", "generate"]],
    ids=["inventory", "config-plan", "cdi-generate"],
)
def test_every_command_that_reads_nvml_takes_the_driver_root(command: list[str], tmp_path: Path) -> None:
    """``run`` and ``cdi generate`` had --driver-root; ``inventory`` and ``config plan`` did not."""
    config = tmp_path / "config.yaml"
    config.write_text("{}\n")
    driver = tmp_path / "driver"
    driver.mkdir()
    args = [str(config) if arg == "CONFIG" else arg for arg in command]
    code, _, err = invoke(*args, "--backend", "nvml", "--driver-root", str(driver))
    assert code == 1 and f"libnvidia-ml.so.1 not found under {driver} " in err, err


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
    assert [owner for _, _, owner, _ in lines] == ["device-plugin"] + ["dra"] * 7
    assert {mode for _, _, _, mode in lines} == {"whole"}
    code, out, _ = invoke("config", "check", str(path), "--node-name", "n1")
    assert code == 0 and "cluster default owner: device-plugin" in out


PUBLISH = """
ownership: {default: dra}
dra:
  publish:
    default: whole
    nodes:
      - match: {labels: {pool: mig}}
        default: dynamic-mig
        gpus: {"7": shared, "GPU-nope": shared}
  sharing: {mps: true}
"""


def test_config_check_prints_the_dra_publish_modes(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(PUBLISH)
    code, out, _ = invoke("config", "check", str(path), "--node-name", "n1", "--label", "pool=mig", "--simulated")
    assert code == 0, out
    assert "matched dra.publish.nodes[0]; DRA publishes GPUs dynamic-mig" in out and "MPS limits" in out
    lines = [line.split() for line in out.splitlines() if line.startswith("    ")]
    assert [mode for *_, mode in lines] == ["dynamic-mig"] * 7 + ["shared"]
    assert "warning: dra.publish.nodes[0].gpus['GPU-nope']: no GPU with that UUID" in out
    code, out, _ = invoke("config", "check", str(path), "--node-name", "n1")
    assert code == 0 and "DRA publishes GPUs whole (dra.publish.default)" in out


def test_config_check_names_a_bad_publish_mode(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("dra: {publish: {nodes: [{match: {names: [a]}, gpus: {'0': sliced}}]}}")
    code, out, err = invoke("config", "check", str(path))
    assert code != 0
    assert (
        "dra.publish.nodes[0].gpus['0']: expected one of 'whole' | 'dynamic-mig' | 'shared', got 'sliced'" in out + err
    )


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

    import agent.runtime.app
    from agent.cli.run import _run

    unwound = asyncio.Event()
    starting = asyncio.Event()

    async def slow_start(options: object, *, stop: asyncio.Event, on_agent: object = None) -> None:
        try:
            starting.set()
            await asyncio.Event().wait()  # e.g. NVML initialising on a sick node
        finally:
            unwound.set()

    monkeypatch.setattr(agent.runtime.app, "run_agent", slow_start)
    task = asyncio.create_task(_run(object()))
    await asyncio.wait_for(starting.wait(), 5)
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(task, 5) == 0
    assert unwound.is_set()


#: what the console script does, with a Ctrl-C arriving while the module named in argv[1] loads
INTERRUPTED_WHILE_LOADING = """
import sys

class CtrlC:
    def __init__(self, module):
        self.module = module

    def find_spec(self, name, path=None, target=None):
        if name == self.module:
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, CtrlC(sys.argv.pop(1)))
from agent.__main__ import main
main()
"""


@pytest.mark.parametrize(
    "module",
    [
        "agent.cli.run",  # the command line of ``run`` (it loads no typer: agent/cli/run.py)
        "agent.runtime.app",  # inside ``run``, before it has taken SIGINT over
        "uvloop",  # choosing the event loop
    ],
)
def test_ctrl_c_before_the_agent_handles_signals_is_quiet(module: str, tmp_path: Path) -> None:
    """A KeyboardInterrupt traceback came out of a Ctrl-C in the first half second."""
    import subprocess
    import sys

    args = ["run", "--simulated", "--debug-addr", "127.0.0.1:0"]
    args += ["--kubelet-root", str(tmp_path / "k"), "--cdi-root", str(tmp_path / "c"), "--state-dir", str(tmp_path)]
    result = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_WHILE_LOADING, module, *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (result.returncode, result.stdout, result.stderr.strip()) == (130, "", "")


# --- first contact: every mistake is one line ----------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bogus"], "gpu-agent: error: No such command 'bogus'. (see 'gpu-agent --help')"),
        (["run", "--bogus"], "gpu-agent: error: No such option: --bogus (see 'gpu-agent run --help')"),
        (["cdi", "bogus"], "gpu-agent: error: No such command 'bogus'. (see 'gpu-agent cdi --help')"),
        (["config", "check"], "gpu-agent: error: Missing argument 'FILE'. (see 'gpu-agent config check --help')"),
        (["inventory", "extra"], "gpu-agent: error: Got unexpected extra argument(s) (extra)"),
    ],
)
def test_usage_errors_are_one_line_on_stderr_with_exit_2(args: list[str], message: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [result.stderr.strip()] and result.stderr.startswith(message)


def test_no_arguments_prints_the_help() -> None:
    result = run_cli()
    assert result.returncode == 2 and "Usage: gpu-agent" in result.stdout and result.stderr == ""
    assert run_cli("run", "--help").returncode == 0


def test_cdi_generate_without_gpus_is_one_line() -> None:
    result = run_cli("cdi", "generate", env={"LD_LIBRARY_PATH": "/nonexistent"})
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("gpu-agent: error: this node has no GPUs")
    assert result.stderr.endswith(": there is no device plugin spec to generate\n")
    assert result.stderr.count("\n") == 1


def test_cdi_check_of_a_missing_directory_is_one_line_on_stderr(tmp_path: Path) -> None:
    result = run_cli("cdi", "check", str(tmp_path / "nope"))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == f"gpu-agent: error: cannot check {tmp_path / 'nope'}: not a directory\n"


@pytest.mark.parametrize("command", [["run"], ["inventory"], ["cdi", "generate"]])
def test_a_preset_without_the_simulated_backend_is_refused(command: list[str]) -> None:
    result = run_cli(*command, "--preset", "a100-4x-mig", env={"LD_LIBRARY_PATH": "/nonexistent"})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        "gpu-agent: error: --preset a100-4x-mig describes a simulated node, but the backend is auto: add --simulated\n"
    )
    assert invoke("inventory", "--simulated", "--preset", "a100-4x-mig")[0] == 0
    assert invoke("inventory", "--backend", "simulated", "--preset", "a100-4x-mig")[0] == 0


def test_a_config_that_is_a_directory_stops_the_agent_with_one_line(tmp_path: Path) -> None:
    result = run_cli("run", "--simulated", "--config", str(tmp_path), "--debug-addr", "127.0.0.1:0")
    assert result.returncode == 2 and result.stdout == ""
    expected = f"gpu-agent: error: cannot read config file {tmp_path}: it is a directory, not a regular file\n"
    assert result.stderr == expected


def test_config_check_finds_the_node_as_run_does(tmp_path: Path) -> None:
    """node_name defaults to NODE_NAME, then to the host name (docs/configuration.md), for `config check` too."""
    import socket

    host = socket.gethostname()
    path = tmp_path / "c.yaml"
    path.write_text(f"ownership:\n  nodes:\n    - match: {{names: [from-env, {host}]}}\n      default: dra\n")
    by_env = run_cli("config", "check", str(path), env={"NODE_NAME": "from-env"})
    assert by_env.returncode == 0 and "node from-env " in by_env.stdout and "default owner: dra" in by_env.stdout
    by_host = run_cli("config", "check", str(path), env={"NODE_NAME": ""})
    assert by_host.returncode == 0 and f"node {host} " in by_host.stdout and "default owner: dra" in by_host.stdout
    by_flag = run_cli("config", "check", str(path), "--node-name", "other", env={"NODE_NAME": "from-env"})
    assert "node other " in by_flag.stdout and "cluster default owner: device-plugin" in by_flag.stdout
