"""The shipped example config and the DaemonSet's ConfigMap stay valid."""

from __future__ import annotations

from pathlib import Path

import yaml

from agent.config.loader import build_config, read_document
from agent.config.schema import Owner

ROOT = Path(__file__).resolve().parents[1]


def test_example_config_is_valid() -> None:
    config = build_config(read_document(ROOT / "config" / "example-config.yaml"))
    assert config.ownership.nodes[0].default is Owner.DRA
    assert config.plugin.device_list_strategy == ("cdi-cri", "envvar")


def test_daemonset_configmap_is_valid() -> None:
    documents = list(yaml.safe_load_all((ROOT / "config" / "daemonset.yaml").read_text()))
    configmap = next(d for d in documents if d["kind"] == "ConfigMap")
    config = build_config(yaml.safe_load(configmap["data"]["config.yaml"]))
    assert config.ownership.default is Owner.DEVICE_PLUGIN


def test_daemonset_mounts_the_driver_root_it_names() -> None:
    """The agent loads libnvidia-ml.so.1 from paths.driver_root: the pod must mount it there,
    and paths.host_driver_root must be that mount's host path (CDI specs name host paths)."""
    documents = list(yaml.safe_load_all((ROOT / "config" / "daemonset.yaml").read_text()))
    pod = next(d for d in documents if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == env["GPU_AGENT_DRIVER_ROOT"])
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"]["path"] == env["GPU_AGENT_HOST_DRIVER_ROOT"]
    assert mount["mountPropagation"] == "HostToContainer"  # a driver container's files appear later
