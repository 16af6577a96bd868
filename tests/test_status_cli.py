"""``gpu-agent status``: an operator's view of the node, from the running agent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.cli.status import render, rows_from_state, summary
from tests.agentproc import AgentProcess, run_cli, wait_for
from tests.test_plugin_fakes import short_tmpdir

STATE = {
    "node": {"name": "gpu-node-7"},
    "status": "serving",
    "backend": "nvml",
    "driver_version": "570.124.06",
    "devices": [
        {
            "index": 1,
            "uuid": "GPU-bbbb",
            "owner": "draining:device-plugin->dra",
            "desired_owner": "dra",
            "health": "healthy",
            "memory_mib": 81559,
            "holders": {"device-plugin": [{"kind": "container", "namespace": "ml", "name": "train-0"}]},
            "utilization": {"gpu_percent": 97.0, "memory_used_mib": 40960, "memory_total_mib": 81559},
        },
        {
            "index": 2,
            "uuid": "GPU-cccc",
            "owner": "device-plugin",
            "desired_owner": "device-plugin",
            "health": "healthy",
            "memory_mib": 81559,
            "holders": {"device-plugin": []},
            "utilization": {"known": False, "gpu_percent": None, "reason": "the newest reading is 31.0s old"},
        },
        {
            "index": 3,
            "uuid": "GPU-dddd",
            "owner": "device-plugin",
            "desired_owner": "device-plugin",
            "health": "healthy",
            "mig_enabled": True,
            "memory_mib": 40960,
            "holders": {},
            "utilization": {"known": True, "gpu_percent": None, "memory_used_mib": 1024, "memory_total_mib": 40960},
        },
        {
            "index": 0,
            "uuid": "GPU-aaaa",
            "owner": "dra",
            "desired_owner": "dra",
            "health": "unhealthy",
            "health_detail": {"cause": "xid 79: GPU has fallen off the bus"},
            "memory_mib": 81559,
            "holders": {"dra": [{"kind": "claim", "namespace": "ml", "name": "c1"}]},
        },
    ],
    "orphans": {
        "count": 1,
        "orphans": [
            {
                "kind": "device-plugin-pod",
                "namespace": "ml",
                "name": "gone-" + "x" * 80,
                "reason": "the API server has no such pod, but the kubelet's PodResources still lists it",
            }
        ],
    },
    "watchdog": {
        "disagreements": [
            {
                "state": "repairing",
                "mechanism": "device-plugin",
                "check": "nvidia.com/gpu kubelet-allocatable",
                "detail": "the kubelet counts 0 allocatable nvidia.com/gpu, we list 8 healthy",
            }
        ]
    },
}


def test_rows_and_the_80_column_view() -> None:
    rows = rows_from_state(STATE)
    assert [r.index for r in rows] == [0, 1, 2, 3]
    assert rows[1].holders == ("ml/train-0",) and rows[0].holders == ("claim ml/c1",)
    assert rows[1].gpu_percent == 97.0 and rows[0].gpu_percent is None
    text = render(STATE, rows)
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "drain dp->dra" in text and "97%" in text and "40/80GiB" in text
    assert "xid 79: GPU has fallen off the bus" in text
    rows_text = [line for line in text.splitlines() if line[:3].strip().isdigit()]
    utilization = {line[:3].strip(): line[40:44].strip() for line in rows_text}  # the UTIL column
    assert utilization == {"0": "-", "1": "97%", "2": "?", "3": "mig"}  # not sampled, read, stale, MIG mode
    assert rows[2].as_dict()["utilization_reason"] == "the newest reading is 31.0s old"
    assert "orphaned allocations: 1" in text and "  device-plugin-pod ml/gone-xxx" in text
    assert "watchdog: 1 disagreement(s) with the node" in text
    assert "  repairing: device-plugin nvidia.com/gpu kubelet-allocatable\n    the kubelet counts 0" in text


NOT_LISTENING = "cannot listen on /var/lib/kubelet/device-plugins/gpu-node-agent-nvidia-gpu.sock: Permission denied"
TROUBLED = {
    **STATE,
    "readiness": {
        "ready": False,
        "checks": {
            "inventory": "4 GPUs (nvml)",
            "device-plugin": NOT_LISTENING,
            "cdi": "/var/run/cdi: Permission denied",
        },
        "failing": ["device-plugin", "cdi"],
    },
    "config": {"version": "a1b2c3", "last_error": "ownership.default: expected one of device-plugin, dra, none"},
    "mechanisms": {
        "device-plugin": {"usage": {"known": False, "reason": "no PodResources socket at /k/kubelet.sock"}},
        "dra": {"usage": {"known": True, "reason": ""}},
    },
}


def test_status_carries_what_readyz_knows() -> None:
    """It said "serving" over healthy GPUs while /readyz was 503, showed no refused config, and
    showed an unknown holder as "-", which reads as nobody."""
    rows = rows_from_state(TROUBLED)
    text = render(TROUBLED, rows)
    assert all(len(line) <= 80 for line in text.splitlines()), text
    lines = text.splitlines()
    assert lines[0].startswith("node gpu-node-7  NOT READY  serving")
    assert "not ready: device-plugin: cannot listen on" in text and "not ready: cdi: /var/run/cdi: Permission" in text
    assert "config refused, still on version a1b2c3: ownership.default: expected one of" in text
    assert "held by ?: device-plugin cannot tell who uses its GPUs: no PodResources socket" in text
    held = {line[:3].strip(): line[61:].strip() for line in lines if line[:3].strip().isdigit()}
    # GPU 1 drains from the device plugin and 2, 3 are its own: unknown; 0 is DRA's, which can tell
    assert held == {"0": "claim ml/c1", "1": "ml/train-0 +?", "2": "?", "3": "?"}
    doc = summary(TROUBLED, rows)
    assert doc["ready"] is False and doc["not_ready"] == {
        "device-plugin": NOT_LISTENING,
        "cdi": "/var/run/cdi: Permission denied",
    }
    assert doc["config_error"] == "ownership.default: expected one of device-plugin, dra, none"
    assert [g["holders_known"] for g in doc["gpus"]] == [True, False, False, False]  # type: ignore[index]


@pytest.mark.integration
def test_status_against_a_running_agent() -> None:
    with short_tmpdir() as root:  # socket paths stay under 108 bytes
        _status_against_a_running_agent(root)


def _status_against_a_running_agent(root: Path) -> None:
    config = root / "config.yaml"
    config.write_text("{}\n")
    agent = AgentProcess(root, ["--simulated", "--config", str(config)])
    try:
        agent.wait_ready()
        result = run_cli("status", "--json", "--debug-addr", f"127.0.0.1:{agent.port}")
        assert result.returncode == 0, result.stderr
        doc = json.loads(result.stdout)
        assert doc["node"] == "test-node" and len(doc["gpus"]) == 8
        assert {g["owner"] for g in doc["gpus"]} == {"device-plugin"}
        assert all(set(g) >= {"desired_owner", "health", "holders", "gpu_utilization_percent"} for g in doc["gpus"])
        table = run_cli("status", "--debug-addr", f"127.0.0.1:{agent.port}")
        assert table.returncode == 0 and "node test-node  ready  serving" in table.stdout
        assert "held by ?: device-plugin cannot tell who uses its GPUs: no PodResources socket" in table.stdout
        config.write_text("ownership: {default: everyone}\n")  # refused: the agent keeps the last good one

        def refused() -> str:
            out = run_cli("status", "--debug-addr", f"127.0.0.1:{agent.port}").stdout
            return out if "config refused, still on version" in out else ""

        assert "ownership.default" in wait_for(refused, 15, "the refused config on the status")
    finally:
        agent.kill()
    down = run_cli("status", "--debug-addr", "127.0.0.1:1")
    assert down.returncode != 0
    assert down.stderr.strip().startswith("gpu-agent: error: no agent answered at http://127.0.0.1:1/debug/state")
    assert len(down.stderr.strip().splitlines()) == 1
