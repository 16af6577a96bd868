"""``gpu-agent config plan``: what a config would move, before it is applied."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.config.loader import build_config
from agent.core.ownership.plan import PlanRow, plan_rows, render
from agent.core.ownership.table import compute_ownership
from tests.agentproc import AgentProcess, run_cli, wait_for
from tests.test_ownership import _inventory

PLAN = """
ownership:
  default: device-plugin
  nodes:
    - match: {names: [test-node]}
      gpus: {'0': dra, '9': none}
"""


def test_rows_name_the_rule_and_what_a_move_waits_for() -> None:
    config = build_config({"ownership": {"nodes": [{"match": {"names": ["n1"]}, "gpus": {"1": "dra"}}]}})
    desired = compute_ownership(_inventory(), config.ownership, node_name="n1", node_labels={}, version="p")
    current = {f"GPU-{i}": "device-plugin" for i in range(4)}
    rows = plan_rows(_inventory(), desired, current=current, holders={"GPU-1": ["pod ml/a"], "GPU-2": ["pod ml/b"]})
    assert rows[1] == PlanRow(1, "GPU-1", "device-plugin", "dra", "ownership.nodes[0].gpus['1']", ("pod ml/a",))
    assert rows[2].waits_for == () and not rows[2].moves  # held, but not moving: nothing to wait for
    text = render(rows, node="n1", source="test")
    assert "1 of 4 GPUs would move" in text and "waits for pod ml/a" in text
    assert all(len(line) <= 80 for line in text.splitlines())


NO_PODRESOURCES = "no PodResources socket at /k/pod-resources/kubelet.sock (is the kubelet running?)"


def test_a_move_away_from_a_mechanism_that_cannot_tell_waits_for_its_answer() -> None:
    """The handover never takes an unknown user for idle: without PodResources a move off the
    device plugin waits for ever. The plan said it waited for nothing."""
    gpus = {"0": "device-plugin", "1": "dra", "2": "dra", "3": "dra"}
    config = build_config({"ownership": {"nodes": [{"match": {"names": ["n1"]}, "gpus": gpus}]}})
    desired = compute_ownership(_inventory(), config.ownership, node_name="n1", node_labels={}, version="p")
    current = {"GPU-0": "dra", "GPU-1": "device-plugin", "GPU-2": "draining:device-plugin->dra", "GPU-3": "none"}
    rows = plan_rows(_inventory(), desired, current=current, holders={}, unknown={"device-plugin": NO_PODRESOURCES})
    answer = f"an answer from device-plugin on who uses it: {NO_PODRESOURCES}"
    assert [r.waits_for for r in rows] == [(), (answer,), (answer,), ()]
    text = render(rows, node="n1", source="test")
    assert "waits for an answer from device-plugin on who uses it: no PodResources" in text
    assert all(len(line) <= 80 for line in text.splitlines())


@contextlib.contextmanager
def planned_by_a_running_agent(tmp_path: Path, config_text: str) -> Iterator[tuple[AgentProcess, Path, Any]]:
    """An agent on ``config_text``, and ``config plan --json`` of PLAN against it."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    config = tmp_path / "config.yaml"
    config.write_text(config_text)
    agent = AgentProcess(tmp_path, ["--simulated", "--config", str(config)])
    try:
        agent.wait_ready()
        result = run_cli("config", "plan", str(plan), "--json", "--debug-addr", f"127.0.0.1:{agent.port}")
        assert result.returncode == 0, result.stderr
        yield agent, config, json.loads(result.stdout)
    finally:
        agent.kill()


@pytest.mark.integration
def test_without_a_kubelet_the_plan_and_the_agent_say_a_move_waits_for_podresources(tmp_path: Path) -> None:
    """``config plan`` said ``"waits_for": []``, and so did the agent's own plan log, for a move
    that waits as long as no PodResources socket can say who uses the GPU."""
    with planned_by_a_running_agent(tmp_path, "ownership: {default: device-plugin}\n") as (agent, config, doc):
        waits = doc["gpus"][0]["waits_for"]
        assert len(waits) == 1 and waits[0].startswith("an answer from device-plugin on who uses it: no PodResources")
        config.write_text(PLAN)  # applied live: the agent logs its plan first
        logged = wait_for(lambda: [line for line in agent.output().splitlines() if '"config plan"' in line], 15)
        assert json.loads(logged[0])["waits_for"] == waits


@pytest.mark.integration
def test_plan_against_a_running_agent_and_without_one(tmp_path: Path) -> None:
    with planned_by_a_running_agent(tmp_path, "cdi: {enabled: false}\nplugin: {enabled: false}\n") as (agent, _, doc):
        assert doc["node"] == "test-node" and doc["source"] == "current state from the running agent"
        first = doc["gpus"][0]
        assert (first["current"], first["desired"], first["moves"]) == ("device-plugin", "dra", True)
        assert [g["moves"] for g in doc["gpus"]].count(True) == 1
        assert "gpus['9']" in doc["warnings"][0]
        # the agent applied nothing
        assert agent.state()["devices"][0]["owner"] == "device-plugin"
    plan = tmp_path / "plan.yaml"
    offline = run_cli(
        "config", "plan", str(plan), "--simulated", "--node-name", "test-node", "--debug-addr", "127.0.0.1:1"
    )
    assert offline.returncode == 0, offline.stderr
    assert "no running agent" in offline.stdout and "current owners unknown" in offline.stdout
    assert "  0  GPU-" in offline.stdout and "dra" in offline.stdout.splitlines()[2]
