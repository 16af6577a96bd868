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
