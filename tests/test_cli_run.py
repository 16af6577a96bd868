"""``gpu-agent run`` reads its own arguments, so the agent's process never loads typer; anything
it does not plainly understand goes to the typer command line, which answers as before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from agent.cli.main import app
from agent.cli.run import RUN_OPTIONS, parse_run_args
from tests.agentproc import run_cli

ENV: dict[str, str] = {}


def test_every_option_in_each_spelling() -> None:
    args = ["-c", "/etc/a.yaml", "--backend=nvml", "--simulated", "--preset", "h100-8x-nvlink"]
    args += ["--node-name", "n1", "--kubelet-root=/k", "--device-plugins-dir", "/k/dp", "--cdi-root", "/c"]
    args += ["--state-dir", "/s", "--driver-root", "/run/nvidia/driver", "--host-driver-root=/hd"]
    args += ["--debug-addr", "127.0.0.1:0", "--kubeconfig", "/kc", "--log-level", "debug"]
    assert parse_run_args(args, ENV) == {
        "config": Path("/etc/a.yaml"),
        "backend": "nvml",
        "simulated": True,
        "preset": "h100-8x-nvlink",
        "node_name": "n1",
        "paths__kubelet_root": Path("/k"),
        "paths__device_plugins_dir": Path("/k/dp"),
        "paths__cdi_root": Path("/c"),
        "paths__state_dir": Path("/s"),
        "paths__driver_root": Path("/run/nvidia/driver"),
        "paths__host_driver_root": Path("/hd"),
        "debug_addr": "127.0.0.1:0",
        "kubeconfig": "/kc",
        "log_level": "debug",
    }


def test_the_last_of_a_repeated_option_counts_and_the_environment_gives_the_config() -> None:
    assert parse_run_args(["--node-name", "a", "--node-name=b"], ENV) == {"node_name": "b"}
    assert parse_run_args([], {"GPU_AGENT_CONFIG": "/cm/config.yaml"}) == {"config": Path("/cm/config.yaml")}
    assert parse_run_args(["--config", "/x.yaml"], {"GPU_AGENT_CONFIG": "/y.yaml"}) == {"config": Path("/x.yaml")}


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--bogus"],
        ["--simulated=yes"],
        ["--node-name"],  # no value
        ["--node-name", "--simulated"],  # a value that looks like an option
        ["--log-level=-1"],
        ["positional"],
        ["--", "--simulated"],
        ["-cfile.yaml"],
        ["-c=file.yaml"],
    ],
)
def test_anything_else_goes_to_the_typer_command_line(args: list[str]) -> None:
    assert parse_run_args(args, ENV) is None


def test_an_empty_environment_value_goes_to_the_typer_command_line() -> None:
    assert parse_run_args([], {"GPU_AGENT_CONFIG": ""}) is None


def test_the_typer_command_takes_exactly_these_options() -> None:
    """``gpu-agent run --help`` (typer) and the agent's own reading name the same options."""
    command = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    typer_side = {
        (tuple(sorted(p.opts + p.secondary_opts)), bool(p.is_flag), p.envvar)
        for p in command.params
        if p.param_type_name == "option" and "--help" not in p.opts
    }
    ours = {(tuple(sorted(o.names)), o.is_flag, o.envvar) for o in RUN_OPTIONS}
    assert typer_side == ours
    dests = {p.name for p in command.params if p.param_type_name == "option"} - {"help"}
    assert {o.dest.removeprefix("paths__") for o in RUN_OPTIONS} == dests


#: the agent's process, failing at once on a config it cannot read: what it loaded by then
LOADED_AT_EXIT = """
import atexit, sys
atexit.register(lambda: print("loaded:", sorted(m for m in ("typer", "click", "rich") if m in sys.modules)))
from agent.__main__ import main
main()
"""


def test_the_agents_process_never_loads_typer(tmp_path: Path) -> None:
    args = ["run", "--simulated", "--config", str(tmp_path), "--debug-addr", "127.0.0.1:0"]
    result = subprocess.run(
        [sys.executable, "-c", LOADED_AT_EXIT, *args], capture_output=True, text=True, timeout=30, env={}
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"gpu-agent: error: cannot read config file {tmp_path}: it is a directory")
    assert result.stdout == "loaded: []\n"


def test_help_and_mistakes_still_get_the_typer_answers() -> None:
    assert "--kubelet-root" in run_cli("run", "--help").stdout
    result = run_cli("run", "--simulated=yes")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith("gpu-agent: error: Option '--simulated' does not take a value.")
