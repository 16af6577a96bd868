"""The Grafana dashboard under config/grafana: it loads, and every query names a metric the agent exports.

The exported names come from a running agent's /metrics (simulated GPUs, the fake API server
for the API-side registries), so a renamed or removed metric fails here, not on an operator's
empty panel.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agentproc import AgentProcess
from tests.fake_apiserver import NODE, serving, write_kubeconfig
from tests.test_plugin_fakes import short_tmpdir

DASHBOARD = Path(__file__).resolve().parent.parent / "config" / "grafana" / "gpu-node-agent.json"
_METRIC = re.compile(r"\bgpu_agent_[a-zA-Z0-9_]+")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    out += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return out


def exported(exposition: str) -> set[str]:
    """Names a query may use: every family's TYPE name, and a histogram's series names."""
    names: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name)
            if kind == "histogram":
                names.update(name + suffix for suffix in _HISTOGRAM_SUFFIXES)
    return names


def test_the_dashboard_is_well_formed() -> None:
    dashboard = load()
    assert dashboard["uid"] == "gpu-node-agent" and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            assert 'instance=~"$instance"' in expr, expr  # every panel follows the node picker
    # what operators asked for: owner map, health, holders, utilization, orphans, prepare latency
    used = {m for q in queries(dashboard) for m in _METRIC.findall(q)}
    assert {
        "gpu_agent_gpu_info",
        "gpu_agent_gpu_health",
        "gpu_agent_gpu_holder_info",
        "gpu_agent_gpu_utilization_ratio",
        "gpu_agent_orphans",
        "gpu_agent_dra_claim_duration_seconds_bucket",
    } <= used


@pytest.mark.integration
def test_every_query_names_a_metric_the_agent_exports() -> None:
    with short_tmpdir() as root:
        exposition = asyncio.run(_scrape_a_running_agent(root))
    names = exported(exposition)
    missing = sorted({m for q in queries(load()) for m in _METRIC.findall(q)} - names)
    assert missing == [], f"the dashboard queries metrics the agent does not export: {missing}"


async def _scrape_a_running_agent(root: Path) -> str:
    async with serving() as api:
        config = root / "config.yaml"
        config.write_text("cdi: {enabled: false}\n")
        kubeconfig = write_kubeconfig(root, api.url)
        agent = AgentProcess(
            root, ["--simulated", "--config", str(config), "--kubeconfig", str(kubeconfig), "--node-name", NODE]
        )
        try:
            await asyncio.to_thread(agent.wait_ready)
            url = f"http://127.0.0.1:{agent.port}/metrics"
            return await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
        finally:
            agent.kill()
