"""The DaemonSet mounts exactly the host directories the agent uses with its default paths, at
the same paths, and sets only environment the agent reads. Changing a path default in
agent/core/config/schema.py (or the env that overrides one) without the manifests fails here."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from agent.cdi.roots import RootMapping
from agent.core.config.loader import ENV_FIELDS, ENV_PREFIX, build_config, env_overrides
from agent.core.config.schema import Config
from tests.manifests import AGENT_KUSTOMIZATIONS, agent_container, only, render

#: GPU_AGENT_* variables the agent reads besides ENV_FIELDS (the CLI's --config)
EXTRA_AGENT_ENV = {"GPU_AGENT_CONFIG"}


def _daemonset(directory: str) -> dict[str, Any]:
    return only(render(directory), "DaemonSet")


def _env(container: dict[str, Any]) -> dict[str, Any]:
    names = [e["name"] for e in container.get("env", [])]
    assert len(names) == len(set(names)), f"duplicate env: {names}"
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _effective_config(env: dict[str, Any]) -> Config:
    """The config the agent builds from the DaemonSet's env (the ConfigMap sets no paths)."""
    plain = {k: v for k, v in env.items() if isinstance(v, str)}
    return build_config({}, env_overrides(plain))


def _mounts(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    volumes = {v["name"]: v for v in pod["volumes"]}
    out = {}
    for mount in container["volumeMounts"]:
        assert "subPath" not in mount and "subPathExpr" not in mount, f"{mount['mountPath']}: subPath never updates"
        out[mount["mountPath"]] = (mount, volumes[mount["name"]])
    return out


def _visible_host_root(config: Config) -> Path:
    mapping = RootMapping(config.paths.driver_root, config.paths.host_driver_root or config.paths.driver_root)
    root = mapping.visible_host_root()
    assert root is not None, "the driver root must lie under a mount of the host's /"
    return root


@pytest.mark.parametrize("directory", AGENT_KUSTOMIZATIONS)
def test_kubelet_and_cdi_paths_are_the_defaults(directory: str) -> None:
    # the manifests mount the kubelet's real directories; they never move the agent's paths by env
    config = _effective_config(_env(agent_container(_daemonset(directory))))
    defaults = Config()
    assert config.paths.kubelet_root == defaults.paths.kubelet_root
    assert config.device_plugins_dir == defaults.device_plugins_dir
    assert config.dra_plugin_dir == defaults.dra_plugin_dir
    assert config.state_dir == defaults.state_dir
    assert config.paths.cdi_root == defaults.paths.cdi_root


@pytest.mark.parametrize("directory", AGENT_KUSTOMIZATIONS)
def test_mounts_are_exactly_the_directories_the_agent_uses(directory: str) -> None:
    daemonset = _daemonset(directory)
    pod = daemonset["spec"]["template"]["spec"]
    container = agent_container(daemonset)
    env = _env(container)
    config = _effective_config(env)
    kubelet_root = config.paths.kubelet_root
    # container path -> (host path, read-only): the kubelet's directories keep their host paths
    # because the kubelet dials the DRA socket at the path the plugin registers
    wanted: dict[Path, tuple[Path, bool]] = {
        config.device_plugins_dir: (config.device_plugins_dir, False),
        kubelet_root / "plugins_registry": (kubelet_root / "plugins_registry", False),
        config.dra_plugin_dir: (config.dra_plugin_dir, False),
        # connect() to a Unix socket is allowed through a read-only mount (only files,
        # directories and links get EROFS), so the PodResources client needs no write access
        kubelet_root / "pod-resources": (kubelet_root / "pod-resources", True),
        config.paths.cdi_root: (config.paths.cdi_root, False),
        # the host's / (read-only), under which the driver root lies: where the agent finds the
        # driver, the host's live /dev and the toolkit's hook
        _visible_host_root(config): (Path("/"), True),
    }
    mounts = _mounts(pod, container)
    host_mounts = {
        Path(p): (Path(v["hostPath"]["path"]), bool(m.get("readOnly")))
        for p, (m, v) in mounts.items()
        if "hostPath" in v
    }
    assert host_mounts == wanted
    # the state directory (the DRA checkpoint) lies in a writable one of them
    assert any(config.state_dir.is_relative_to(p) and not ro for p, (_, ro) in wanted.items())
    # the driver may be mounted by a driver container after the agent starts
    driver_mount, _ = mounts[str(_visible_host_root(config))]
    assert driver_mount["mountPropagation"] == "HostToContainer"

    config_dir = str(PurePosixPath(env["GPU_AGENT_CONFIG"]).parent)
    mount, volume = mounts[config_dir]
    assert "configMap" in volume and mount.get("readOnly") is True
    # besides: scratch space only
    others = {p: v for p, (_, v) in mounts.items() if "hostPath" not in v and p != config_dir}
    assert all("emptyDir" in v for v in others.values()), others
    assert set(others) == {"/tmp"} | ({env["LD_LIBRARY_PATH"]} if "LD_LIBRARY_PATH" in env else set())


@pytest.mark.parametrize("directory", AGENT_KUSTOMIZATIONS)
def test_env_is_what_the_agent_reads(directory: str) -> None:
    env = _env(agent_container(_daemonset(directory)))
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    agent_env = {n for n in env if n.startswith(ENV_PREFIX)}
    known = {ENV_PREFIX + n for n in ENV_FIELDS} | EXTRA_AGENT_ENV
    assert agent_env <= known, f"the agent reads none of {sorted(agent_env - known)}"
    assert "GPU_AGENT_NODE_NAME" not in env  # NODE_NAME from the downward API is the one source


@pytest.mark.parametrize("directory", AGENT_KUSTOMIZATIONS)
def test_probes_reach_the_debug_endpoint_on_loopback(directory: str) -> None:
    daemonset = _daemonset(directory)
    pod = daemonset["spec"]["template"]["spec"]
    container = agent_container(daemonset)
    host, _, port = _effective_config(_env(container)).debug_addr.rpartition(":")
    assert host == "127.0.0.1"
    # the kubelet probes from the node's network namespace: loopback is the pod's only with hostNetwork
    assert pod["hostNetwork"] is True
    probes = {k: container[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {p["host"] for p in probes.values()} == {host}
    assert {p["port"] for p in probes.values()} == {int(port)}
    assert probes["livenessProbe"]["path"] == "/healthz"  # never the API-dependent readiness
    assert probes["readinessProbe"]["path"] == "/readyz"


@pytest.mark.parametrize("directory", AGENT_KUSTOMIZATIONS)
def test_one_agent_per_node_during_a_rolling_update(directory: str) -> None:
    strategy = _daemonset(directory)["spec"]["updateStrategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


@pytest.mark.parametrize("directory", AGENT_KUSTOMIZATIONS)
def test_node_critical_gpu_pools_only(directory: str) -> None:
    pod = _daemonset(directory)["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"key": "nvidia.com/gpu", "operator": "Exists"} in pod["tolerations"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = {e["key"] for t in terms for e in t["matchExpressions"]}
    assert keys == {"nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present"}


@pytest.mark.parametrize("directory", AGENT_KUSTOMIZATIONS)
def test_memory_request_covers_the_measured_steady_state(directory: str) -> None:
    resources = agent_container(_daemonset(directory))["resources"]
    assert resources["requests"]["memory"] == "64Mi"  # >= the 60 MiB target with both mechanisms
    assert resources["limits"] == {"memory": "128Mi"}  # no CPU limit: no throttled Allocate


def test_production_overlays_differ_only_in_the_driver_root() -> None:
    host = _daemonset("config/overlays/nvml-host")
    driver_container = _daemonset("config/overlays/nvml-driver-container")
    host_env, dc_env = _env(agent_container(host)), _env(agent_container(driver_container))
    assert host_env["GPU_AGENT_HOST_DRIVER_ROOT"] == "/"
    assert dc_env["GPU_AGENT_HOST_DRIVER_ROOT"] == "/run/nvidia/driver"
    assert host_env["GPU_AGENT_DRIVER_ROOT"] == "/host"
    assert dc_env["GPU_AGENT_DRIVER_ROOT"] == "/host/run/nvidia/driver"
    assert host["spec"]["template"]["spec"]["volumes"] == driver_container["spec"]["template"]["spec"]["volumes"]
    assert agent_container(host)["securityContext"]["privileged"] is True


def test_kind_overlay_runs_simulated_gpus_without_privileges() -> None:
    daemonset = _daemonset("config/overlays/kind-simulated")
    container = agent_container(daemonset)
    env = _env(container)
    assert env["GPU_AGENT_BACKEND"] == "simulated"
    assert "LD_LIBRARY_PATH" not in env
    assert not daemonset["spec"]["template"]["spec"].get("initContainers")
    security = container["securityContext"]
    assert security["privileged"] is False and security["capabilities"] == {"drop": ["ALL"]}
    assert security["runAsUser"] == 0  # the kubelet's directories are root-owned
