"""The agent as users run it: a real process, real HTTP, a real config file on disk."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agentproc import AgentProcess, run_cli, wait_for
from tests.fake_podresources import FakePodResources

pytestmark = pytest.mark.integration

BASE = """
plugin: {enabled: false}
cdi: {enabled: false}
"""


@pytest.fixture
def start(tmp_path: Path) -> Iterator[object]:
    procs: list[AgentProcess] = []

    def _start(*args: str, env: dict[str, str] | None = None) -> AgentProcess:
        proc = AgentProcess(tmp_path, list(args), env)
        procs.append(proc)
        return proc

    yield _start
    for proc in procs:
        proc.kill()


def owners(state: dict[str, object]) -> dict[int, str]:
    return {d["index"]: d["owner"] for d in state["devices"]}  # type: ignore[attr-defined, index]


def test_simulated_agent_lifecycle(tmp_path: Path, start: object) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        BASE + "ownership:\n  default: device-plugin\n  nodes:\n"
        "    - match: {names: [test-node]}\n      gpus: {'0': dra, '7': none}\n"
    )
    agent: AgentProcess = start("--simulated", "--config", str(config))  # type: ignore[operator]
    # the kubelet's PodResources: without it nobody can tell that no pod holds GPU 0 or 7, and
    # their moves away from the device plugin would wait
    pods = FakePodResources(agent.kubelet_root / "pod-resources")
    pods.start_threaded()
    try:
        _lifecycle(agent, config)
    finally:
        pods.stop_threaded()


def _lifecycle(agent: AgentProcess, config: Path) -> None:
    agent.wait_ready()
    wait_for(lambda: "draining" not in str(owners(agent.state())), 10, "the start-up grants")
    state = agent.state()
    assert state["status"] == "serving"
    assert len(state["devices"]) == 8
    assert owners(state) == {
        0: "dra",
        1: "device-plugin",
        2: "device-plugin",
        3: "device-plugin",
        4: "device-plugin",
        5: "device-plugin",
        6: "device-plugin",
        7: "none",
    }
    assert all(d["health"] == "healthy" for d in state["devices"])
    first_version = state["config"]["version"]
    assert state["config"]["source"] == str(config)

    # a live change is applied
    config.write_text(BASE + "ownership:\n  default: dra\n")
    wait_for(lambda: set(owners(agent.state()).values()) == {"dra"}, 5, "the new ownership")
    changed = agent.state()["config"]
    assert changed["version"] != first_version and changed["last_error"] == ""

    # a broken change is rejected, the last good config stays
    config.write_text(BASE + "ownership:\n  default: both\n")
    wait_for(lambda: agent.state()["config"]["last_error"], 5, "the rejection")
    state = agent.state()
    assert "ownership.default" in state["config"]["last_error"]
    assert state["config"]["version"] == changed["version"]
    assert set(owners(state).values()) == {"dra"}

    # an override naming a GPU the node does not have (one that fell off the bus) is inert, not an error
    config.write_text(
        BASE + "ownership:\n  default: dra\n  nodes:\n    - match: {names: [test-node]}\n      gpus: {'12': none}\n"
    )
    wait_for(lambda: agent.state()["ownership"]["inert_overrides"], 5, "the inert override")
    assert "gpus['12']" in agent.state()["ownership"]["inert_overrides"][0]
    assert set(owners(agent.state()).values()) == {"dra"}

    status, metrics = agent.get("/metrics")
    assert status == 200
    assert 'gpu_agent_devices{health="healthy",owner="dra"} 8.0' in metrics
    assert "gpu_agent_config_rejections_total 1.0" in metrics
    assert "gpu_agent_config_reloads_total 2.0" in metrics

    code, _ = agent.terminate()
    assert code == 0, agent.output()


def test_configmap_symlink_swap_is_applied(tmp_path: Path, start: object) -> None:
    """The kubelet updates a ConfigMap volume by renaming the ..data symlink to a new directory."""
    mount = tmp_path / "configmap"
    (mount / "..v1").mkdir(parents=True)
    (mount / "..v1" / "config.yaml").write_text(BASE + "ownership: {default: device-plugin}\n")
    (mount / "..data").symlink_to("..v1")
    (mount / "config.yaml").symlink_to("..data/config.yaml")
    agent: AgentProcess = start("--simulated", "--config", str(mount / "config.yaml"))  # type: ignore[operator]
    agent.wait_ready()
    assert set(owners(agent.state()).values()) == {"device-plugin"}

    (mount / "..v2").mkdir()
    (mount / "..v2" / "config.yaml").write_text(BASE + "ownership: {default: none}\n")
    (mount / "..data_tmp").symlink_to("..v2")
    os.rename(mount / "..data_tmp", mount / "..data")
    wait_for(lambda: {d["desired_owner"] for d in agent.state()["devices"]} == {"none"}, 5, "the swapped config")
    # no kubelet on this machine: nobody can say no pod holds the GPUs, so they drain and wait, saying why
    devices = agent.state()["devices"]
    assert set(owners({"devices": devices}).values()) == {"draining:device-plugin->none"}
    assert all("cannot tell who uses it: no PodResources socket" in d["draining"]["waiting_for"] for d in devices)
    assert agent.terminate()[0] == 0


def test_simulated_health_injection_and_heal(tmp_path: Path, start: object) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(BASE)
    agent: AgentProcess = start("--simulated", "--config", str(config))  # type: ignore[operator]
    agent.wait_ready()
    status, body = agent.post("/debug/simulated/health", {"device": "2", "healthy": False, "xid": 79})
    assert status == 200, body
    device = agent.state()["devices"][2]
    assert device["health"] == "unhealthy"
    assert device["health_detail"]["history"][-1]["xid"] == 79
    status, _ = agent.post("/debug/simulated/health", {"device": "2", "healthy": False, "xid": 13})
    assert status == 200
    status, _ = agent.post("/debug/simulated/health", {"device": "2", "healthy": True})
    assert status == 200
    assert agent.state()["devices"][2]["health"] == "healthy"
    status, body = agent.post("/debug/simulated/health", {"device": "99", "healthy": False})
    assert status == 404 and "99" in body["error"]
    assert agent.terminate()[0] == 0


def test_node_without_gpus_is_ready_and_idle(tmp_path: Path, start: object) -> None:
    # this machine has no NVML library, so "auto" must fall back to a quiet no-GPU node
    agent: AgentProcess = start("--backend", "auto", env={"LD_LIBRARY_PATH": str(tmp_path)})  # type: ignore[operator]
    agent.wait_ready()
    status, body = agent.get("/readyz")
    assert status == 200 and body["status"] == "no devices"
    state = agent.state()
    assert state["devices"] == [] and state["status"] == "no devices"
    assert list((agent.kubelet_root / "device-plugins").iterdir()) == []
    assert list(agent.cdi_root.iterdir()) == []
    assert agent.get("/debug/simulated/health")[0] in (404, 405)
    assert agent.terminate()[0] == 0


def test_explicit_nvml_without_a_driver_keeps_running(tmp_path: Path, start: object) -> None:
    """--backend nvml waits for its driver (a driver container may come later), no crash loop."""
    empty = tmp_path / "no-driver"
    empty.mkdir()
    agent: AgentProcess = start(  # type: ignore[operator]
        "--backend", "nvml", "--driver-root", str(empty), env={"LD_LIBRARY_PATH": str(tmp_path)}
    )
    agent.wait_port()
    assert agent.get("/healthz")[0] == 200
    status, body = agent.get("/readyz")
    assert status == 503 and body["checks"]["inventory"].startswith("waiting for NVML")
    assert agent.state()["backend_state"]["name"] == "nvml"
    assert agent.terminate()[0] == 0


@pytest.mark.parametrize(
    ("args", "config_text", "code", "message"),
    [
        (["--simulated"], "ownership: {default: both}\n", 2, "ownership.default: expected one of"),
        (["--simulated"], "unknown_key: 1\n", 2, "unknown_key: unknown field"),
        (["--simulated", "--preset", "no-such-preset"], "", 2, "no-such-preset"),
        (["--backend", "cuda"], "", 2, "backend: expected one of"),
    ],
)
def test_startup_errors_are_one_line(
    tmp_path: Path, args: list[str], config_text: str | None, code: int, message: str
) -> None:
    extra: list[str] = []
    if config_text is not None:
        path = tmp_path / "config.yaml"
        path.write_text(config_text)
        extra = ["--config", str(path)]
    result = run_cli(
        "run",
        *args,
        *extra,
        "--debug-addr",
        "127.0.0.1:0",
        "--kubelet-root",
        str(tmp_path),
        "--cdi-root",
        str(tmp_path / "cdi"),
        env={"LD_LIBRARY_PATH": str(tmp_path)},
    )
    assert result.returncode == code, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("gpu-agent: error:")]
    assert len(errors) == 1, result.stderr
    assert message in errors[0]
    assert "Traceback" not in result.stderr + result.stdout


def test_unreadable_config_file(tmp_path: Path) -> None:
    result = run_cli("run", "--simulated", "--config", str(tmp_path / "absent.yaml"), "--debug-addr", "127.0.0.1:0")
    assert result.returncode == 2
    assert "cannot read config file" in result.stderr and "Traceback" not in result.stderr


def test_debug_port_in_use(tmp_path: Path, start: object) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(BASE)
    first: AgentProcess = start("--simulated", "--config", str(config))  # type: ignore[operator]
    first.wait_ready()
    result = run_cli(
        "run",
        "--simulated",
        "--config",
        str(config),
        "--debug-addr",
        f"127.0.0.1:{first.port}",
        "--kubelet-root",
        str(tmp_path / "k2"),
        "--cdi-root",
        str(tmp_path / "c2"),
    )
    assert result.returncode == 1
    assert f"debug endpoint cannot listen on 127.0.0.1:{first.port}: address already in use" in result.stderr
    assert "Traceback" not in result.stderr


PRESET = """
name: my-node
driver_version: "570.124.06"
cuda_driver_version: "12.8"
defaults: {{product_name: NVIDIA RTX 6000 Ada Generation, architecture: ada, compute_capability: "8.9",
           memory_mib: 49140, numa_node: 0}}
gpus:
{gpus}
topology: {{nvlinks: 0, pcie: hostbridge}}
"""


def test_inventory_change_is_picked_up(tmp_path: Path, start: object) -> None:
    """Editing a simulated preset file stands in for hardware changing under a running agent."""
    preset = tmp_path / "node.yaml"
    two = '  - {pci_bus_id: "00000000:01:00.0"}\n  - {pci_bus_id: "00000000:02:00.0"}'
    preset.write_text(PRESET.format(gpus=two))
    config = tmp_path / "config.yaml"
    config.write_text(BASE + "inventory_refresh_s: 0.1\n")
    agent: AgentProcess = start("--simulated", "--preset", str(preset), "--config", str(config))  # type: ignore[operator]
    agent.wait_ready()
    first = agent.state()["devices"]
    assert len(first) == 2

    preset.write_text(PRESET.format(gpus=two.splitlines()[0]))
    wait_for(lambda: len(agent.state()["devices"]) == 1, 5, "the GPU to disappear")
    assert agent.state()["devices"][0]["uuid"] == first[0]["uuid"]
    _, metrics = agent.get("/metrics")
    assert 'gpu_agent_devices{health="healthy",owner="device-plugin"} 1.0' in metrics
    # the health watch restarted on the new inventory: the remaining GPU still takes injections
    wait_for(
        lambda: agent.post("/debug/simulated/health", {"device": "1", "healthy": True})[0] == 404,
        5,
        "the health watch to follow the new inventory",
    )
    assert agent.post("/debug/simulated/health", {"device": "0", "healthy": False})[0] == 200
    assert agent.state()["devices"][0]["health"] == "unhealthy"

    preset.write_text("gpus: [oops")  # a broken edit keeps the last inventory
    wait_for(lambda: "inventory reload failed" in agent.output(), 5, "the reload failure to be logged")
    assert len(agent.state()["devices"]) == 1
    assert agent.terminate()[0] == 0
