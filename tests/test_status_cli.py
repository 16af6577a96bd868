"""``gpu-agent status``: an operator's view of the node, from the running agent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.cli.status import render, rows_from_state
from tests.agentproc import AgentProcess, run_cli
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


@pytest.mark.integration
def test_status_against_a_running_agent() -> None:
    with short_tmpdir() as root:  # socket paths stay under 108 bytes
        _status_against_a_running_agent(root)


def _status_against_a_running_agent(root: Path) -> None:
    agent = AgentProcess(root, ["--simulated"])
    try:
        agent.wait_ready()
        result = run_cli("status", "--json", "--debug-addr", f"127.0.0.1:{agent.port}")
        assert result.returncode == 0, result.stderr
        doc = json.loads(result.stdout)
        assert doc["node"] == "test-node" and len(doc["gpus"]) == 8
        assert {g["owner"] for g in doc["gpus"]} == {"device-plugin"}
        assert all(set(g) >= {"desired_owner", "health", "holders", "gpu_utilization_percent"} for g in doc["gpus"])
        table = run_cli("status", "--debug-addr", f"127.0.0.1:{agent.port}")
        assert table.returncode == 0 and "node test-node  serving" in table.stdout
    finally:
        agent.kill()
    down = run_cli("status", "--debug-addr", "127.0.0.1:1")
    assert down.returncode != 0
    assert down.stderr.strip().startswith("gpu-agent: error: no agent answered at http://127.0.0.1:1/debug/state")
    assert len(down.stderr.strip().splitlines()) == 1


def _dra(publish: dict[str, object], **rest: object) -> dict[str, object]:
    return {"mechanism_details": {"dra": {"publish": publish, "partitions": [], "shares": [], **rest}}}


def test_a_line_under_each_partitioned_or_shared_gpu() -> None:
    devices = [
        {
            "index": 0,
            "uuid": "GPU-aaaa",
            "owner": "dra",
            "health": "healthy",
            **_dra(
                {"state": "dynamic-mig"},
                partitions=[
                    {"profile": "3g.40gb", "claim": "ml/big"},
                    {"profile": "1g.10gb", "claim": "ml/small-" + "x" * 60},
                    {"profile": "1g.10gb", "claim": "ml/c"},
                ],
                free_counters={**{f"memory-slice-{i}": 0 for i in range(6)}, "memory-slice-6": 1, "memory-slice-7": 1},
            ),
        },
        {
            "index": 1,
            "uuid": "GPU-bbbb",
            "owner": "dra",
            "health": "healthy",
            **_dra(
                {"state": "shared"},
                shares=[{"memory_bytes": 1}, {"memory_bytes": 2}],
                shared_memory={"allocated": "76Gi", "capacity": "81559Mi"},
            ),
        },
        {
            "index": 2,
            "uuid": "GPU-cccc",
            "owner": "dra",
            "health": "healthy",
            **_dra({"state": "changing->whole", "waiting_for": ["ml/a", "ml/b", "ml/c"]}),
        },
        {"index": 3, "uuid": "GPU-dddd", "owner": "dra", "health": "healthy", **_dra({"state": "whole"})},
        {
            "index": 4,
            "uuid": "GPU-eeee",
            "owner": "dra",
            "health": "healthy",
            **_dra({"state": "whole", "note": "shared not possible: the GPU is in MIG mode; published whole"}),
        },
        {"index": 5, "uuid": "GPU-ffff", "owner": "dra", "health": "healthy", "mechanism_details": {"dra": "junk"}},
    ]
    state = {"node": {"name": "n"}, "devices": devices}
    rows = rows_from_state(state)
    text = render(state, rows)
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "     dynamic-mig 2/8 slices free: 3g.40gb ml/big, 1g.10gb ml/small-xxx" in text
    assert "     shared 2 shares, 76Gi of 81559Mi held" in text
    assert "     changing->whole, waits for ml/a, ml/b ..." in text
    assert "     whole: shared not possible: the GPU is in MIG mode" in text
    assert rows[3].partitioning == "" and rows[5].partitioning == ""
