"""A new user's first runs, as an ordinary user: a working agent or one clear line, never a crash.

The tests run as root here, so the agent is started as ``nobody`` (setpriv drops the user and
group before the interpreter starts); run as an ordinary user, they start it as themselves.
Directories stand in for a real node's: a root-owned ``0700`` kubelet root (as on a node, or
after a root run of the quick start), and directories the user cannot create (a clean machine).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agentproc import AgentProcess, run_cli, wait_for

pytestmark = pytest.mark.integration

NOBODY = 65534


@pytest.fixture(scope="module")
def ordinary_user() -> list[str]:
    """The launcher that runs a command as an ordinary user (empty if we are one)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv (util-linux): cannot start the agent as an ordinary user")
    launcher = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    probe = subprocess.run(
        [*launcher, sys.executable, "-c", "import os, agent.runtime.app; print(os.geteuid())"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode != 0 or probe.stdout.strip() != str(NOBODY):
        pytest.skip(f"this interpreter cannot run as uid {NOBODY}: {probe.stderr.strip()[-200:]}")
    return launcher


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    """A short, world-writable scratch root (Unix socket paths are limited to 107 bytes)."""
    root = Path(tempfile.mkdtemp(prefix="fc-", dir="/tmp"))
    root.chmod(0o777)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def locked_dir(path: Path) -> Path:
    """A directory this test's ordinary user cannot read or enter."""
    path.mkdir()
    path.chmod(0o700 if os.geteuid() == 0 else 0o000)
    return path


def readyz(agent: AgentProcess) -> tuple[int, dict[str, object]]:
    status, body = agent.get("/readyz")
    assert isinstance(body, dict), body
    return status, body


def stop(agent: AgentProcess) -> None:
    code, _ = agent.terminate(timeout=10)
    assert code == 0, agent.output()
    assert "Traceback" not in agent.output()


def test_an_unreadable_kubelet_root_is_not_ready_and_no_crash(ordinary_user: list[str]) -> None:
    """It crashed within a second with a 93-line traceback (PermissionError in a readiness check)."""
    with scratch() as root:
        kubelet = locked_dir(root / "kubelet")
        agent = AgentProcess(
            root,
            ["--simulated", "--kubelet-root", str(kubelet)],
            launcher=ordinary_user,
            make_dirs=False,
        )
        try:
            agent.wait_port()
            wait_for(lambda: "device-plugin" in readyz(agent)[1].get("checks", {}), 15, "the device plugin's check")
            assert agent.get("/healthz")[0] == 200
            status, body = readyz(agent)
            assert status == 503 and body["ready"] is False
            checks = body["checks"]
            assert isinstance(checks, dict)
            assert "Permission denied" in str(checks["device-plugin"])
            assert agent.proc.poll() is None
            stop(agent)
        finally:
            agent.kill()


def test_on_a_clean_machine_an_ordinary_user_is_told_why_it_is_not_ready(ordinary_user: list[str]) -> None:
    """The plugin cannot listen and the CDI directory cannot be made: /readyz must not say ready."""
    with scratch() as root:
        system = root / "system"  # stands in for /var: the user cannot create anything in it
        system.mkdir()
        # root's 0755 for the agent run as nobody; an ordinary user running the tests owns it,
        # so only taking its own write bit away denies it
        system.chmod(0o755 if os.geteuid() == 0 else 0o555)
        agent = AgentProcess(
            root,
            [
                "--simulated",
                "--kubelet-root",
                str(system / "lib" / "kubelet"),
                "--cdi-root",
                str(system / "run" / "cdi"),
                "--state-dir",
                str(root / "state"),
            ],
            launcher=ordinary_user,
            make_dirs=False,
        )
        try:
            agent.wait_port()

            def both_checks_failing() -> bool:
                status, body = readyz(agent)
                checks = body.get("checks", {})
                assert isinstance(checks, dict)
                return (
                    status == 503
                    and "Permission denied" in str(checks.get("device-plugin"))
                    and "Permission denied" in str(checks.get("cdi"))
                )

            wait_for(both_checks_failing, 15, "/readyz naming both problems")
            assert not (system / "lib").exists() and not (system / "run").exists()
            # where an operator looks first: it said "serving", every GPU healthy, and nothing else
            shown = run_cli("status", "--debug-addr", f"127.0.0.1:{agent.port}").stdout
            assert " NOT READY " in shown.splitlines()[0], shown
            assert "not ready: device-plugin: " in shown and "not ready: cdi: " in shown, shown
            stop(agent)
        finally:
            agent.kill()


def test_an_unreadable_config_at_start_up_is_one_line(ordinary_user: list[str]) -> None:
    with scratch() as root:
        config = root / "config.yaml"
        config.write_text("{}\n")
        config.chmod(0o600 if os.geteuid() == 0 else 0o000)
        result = run_cli("run", "--simulated", "--config", str(config), launcher=ordinary_user)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"gpu-agent: error: cannot read config file {config}: Permission denied\n"


# --- the README's quick start -----------------------------------------------------------------

README = Path(__file__).resolve().parents[1] / "README.md"
QUICK_START_ROOT = "/tmp/gpu-agent-try"


def quick_start_commands() -> list[list[str]]:
    """The shell commands of the README's first quick-start block, continuation lines joined."""
    text = README.read_text()
    section = text[text.index("## Quick start") :]
    block = section[section.index("```sh\n") + len("```sh\n") : section.index("```\n", section.index("```sh\n") + 6)]
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_quick_start_runs_as_an_ordinary_user_and_writes_only_its_scratch_root(ordinary_user: list[str]) -> None:
    commands = quick_start_commands()
    (run,) = [c for c in commands if c[:2] == [".venv/bin/gpu-agent", "run"]]
    paths = [arg for arg in run if arg.startswith("/")]
    assert {"--kubelet-root", "--cdi-root", "--state-dir"} <= set(run), run
    assert paths and all(p.startswith(f"{QUICK_START_ROOT}/") for p in paths), "the quick start writes outside its root"
    assert ["mkdir", "-p", QUICK_START_ROOT] in commands
    with scratch() as root:
        mine = str(root / "try")
        subprocess.run([*ordinary_user, "/bin/mkdir", "-p", mine], check=True)
        args = [arg.replace(QUICK_START_ROOT, mine) for arg in run[2:]]
        agent = AgentProcess(root, [*args, "--debug-addr", "127.0.0.1:0"], launcher=ordinary_user, make_dirs=False)
        try:
            agent.wait_ready()
            status, body = readyz(agent)
            assert status == 200 and "waiting for the kubelet" in str(body["checks"])
            made = {str(p.relative_to(root)) for p in root.rglob("*")}
            assert "try/kubelet/device-plugins/gpu-node-agent-nvidia-gpu.sock" in made
            assert any(m.startswith("try/cdi/") and m.endswith(".json") for m in made), made
            assert all(m.startswith("try") for m in made), made
            stop(agent)
        finally:
            agent.kill()
