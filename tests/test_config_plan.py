"""``gpu-agent config plan``: what a config would move, before it is applied."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.core.config.loader import build_config
from agent.core.ownership.plan import PlanRow, plan_rows, render
from agent.core.ownership.publish import compute_publish_modes
from agent.core.ownership.table import compute_ownership
from tests.agentproc import AgentProcess, run_cli
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


@pytest.mark.integration
def test_plan_against_a_running_agent_and_without_one(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    config = tmp_path / "config.yaml"
    config.write_text("cdi: {enabled: false}\nplugin: {enabled: false}\n")
    agent = AgentProcess(tmp_path, ["--simulated", "--config", str(config)])
    try:
        agent.wait_ready()
        result = run_cli("config", "plan", str(plan), "--json", "--debug-addr", f"127.0.0.1:{agent.port}")
        assert result.returncode == 0, result.stderr
        doc = json.loads(result.stdout)
        assert doc["node"] == "test-node" and doc["source"] == "current state from the running agent"
        first = doc["gpus"][0]
        assert (first["current"], first["desired"], first["moves"]) == ("device-plugin", "dra", True)
        assert [g["moves"] for g in doc["gpus"]].count(True) == 1
        assert "gpus['9']" in doc["warnings"][0]
        # the agent applied nothing
        assert agent.state()["devices"][0]["owner"] == "device-plugin"
    finally:
        agent.kill()
    offline = run_cli(
        "config", "plan", str(plan), "--simulated", "--node-name", "test-node", "--debug-addr", "127.0.0.1:1"
    )
    assert offline.returncode == 0, offline.stderr
    assert "no running agent" in offline.stdout and "current owners unknown" in offline.stdout
    assert "  0  GPU-" in offline.stdout and "dra" in offline.stdout.splitlines()[2]


def test_rows_show_the_dra_publish_mode_a_gpu_has_and_would_get() -> None:
    document = {
        "ownership": {"default": "dra"},
        "dra": {"publish": {"nodes": [{"match": {"names": ["n1"]}, "gpus": {"1": "shared", "2": "dynamic-mig"}}]}},
    }
    config = build_config(document)
    inventory = _inventory()
    desired = compute_ownership(inventory, config.ownership, node_name="n1", node_labels={}, version="p")
    publish = compute_publish_modes(inventory, config.dra, node_name="n1", node_labels={})
    current = {f"GPU-{i}": "dra" for i in range(4)}
    now = {"GPU-1": "whole", "GPU-2": "changing->dynamic-mig"}
    rows = plan_rows(inventory, desired, current=current, holders={}, publish=publish, publish_now=now)
    assert [(r.publish_now, r.publish) for r in rows] == [
        ("", "whole"),
        ("whole", "shared"),
        ("changing->dynamic-mig", "dynamic-mig"),
        ("", "whole"),
    ]
    text = render(rows, node="n1", source="test")
    assert "DRA publishes it whole -> shared" in text
    assert "DRA publishes it dynamic-mig, after the claims that hold it now" in text
    assert all(len(line) <= 80 for line in text.splitlines())
    assert rows[1].as_dict()["publish"] == "shared"
