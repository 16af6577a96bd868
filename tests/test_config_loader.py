from __future__ import annotations

from pathlib import Path

import pytest

from agent.base.errors import ConfigError
from agent.core.config.loader import build_config, config_digest, env_overrides, load_config, read_document, to_plain
from agent.core.config.schema import APPLICATION_XIDS, Owner, XidRule


def test_empty_document_gives_defaults() -> None:
    config = build_config({})
    assert config.backend == "auto"
    assert config.ownership.default is Owner.DEVICE_PLUGIN
    assert config.debug_addr == "127.0.0.1:9477"
    assert config.paths.kubelet_root == Path("/var/lib/kubelet")
    for xid in APPLICATION_XIDS:
        assert config.health.xids[xid].action == "ignore"


def test_kubelet_directories_default_to_a_stock_kubelet_and_split_when_told() -> None:
    config = build_config({})
    assert config.device_plugins_dir == Path("/var/lib/kubelet/device-plugins")
    assert config.dra.driver_name == "gpu-node-agent.nvidia.com"
    assert config.dra_plugin_dir == Path("/var/lib/kubelet/plugins/gpu-node-agent.nvidia.com")
    assert config.state_dir == config.dra_plugin_dir
    # a kubelet with --root-dir=/data/kubelet still serves device plugins under /var/lib/kubelet
    moved = build_config(
        {"paths": {"kubelet_root": "/data/kubelet", "device_plugins_dir": "/var/lib/kubelet/device-plugins"}},
        {"dra.driver_name": "gpu.example.com", "paths.state_dir": "/var/lib/agent"},
    )
    assert moved.device_plugins_dir == Path("/var/lib/kubelet/device-plugins")
    assert moved.dra_plugin_dir == Path("/data/kubelet/plugins/gpu.example.com")
    assert moved.state_dir == Path("/var/lib/agent")


def test_xid_rules_merge_over_defaults() -> None:
    config = build_config({"health": {"xids": {79: "fatal", "94": "count 3 within 2m", 13: "fatal"}}})
    assert config.health.xids[79] == XidRule(action="fatal")
    assert config.health.xids[94] == XidRule(action="count", count=3, window_s=120.0)
    assert config.health.xids[13].action == "fatal"  # user wins over the default
    assert config.health.xids[31].action == "ignore"  # defaults kept


def test_full_ownership_shape() -> None:
    config = build_config(
        {
            "ownership": {
                "default": "device-plugin",
                "nodes": [
                    {
                        "match": {"names": ["gpu-node-7"]},
                        "default": "dra",
                        "gpus": {"GPU-abc": "device-plugin", 3: "none"},
                    },
                    {"match": {"labels": {"pool": "a100-dra"}}, "default": "dra"},
                ],
            }
        }
    )
    first, second = config.ownership.nodes
    assert first.default is Owner.DRA
    assert first.gpus == {"GPU-abc": Owner.DEVICE_PLUGIN, "3": Owner.NONE}
    assert second.match.labels == {"pool": "a100-dra"}


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"bogus": 1}, "bogus: unknown field"),
        ({"health": {"check_interval": 5}}, "health.check_interval: unknown field"),
        ({"health": {"check_interval_s": "soon"}}, "health.check_interval_s: expected a number, got 'soon'"),
        ({"health": {"check_interval_s": 0}}, "health.check_interval_s: must be a number greater than 0"),
        ({"health": {"xids": {79: "sometimes"}}}, "health.xids[79]: expected 'ignore', 'fatal'"),
        ({"ownership": {"default": "both"}}, "ownership.default: expected one of 'device-plugin' | 'dra' | 'none'"),
        ({"ownership": {"nodes": [{"gpus": {"0": "dra"}}]}}, "ownership.nodes[0].match: name node names or labels"),
        ({"ownership": {"nodes": "x"}}, "ownership.nodes: expected a list"),
        ({"plugin": {"resource_name": "gpu"}}, "plugin.resource_name: 'gpu' is not a valid extended resource name"),
        ({"plugin": {"resource_name": "kubernetes.io/gpu"}}, "not a valid extended resource name"),
        ({"plugin": {"device_list_strategy": ["envvar", "envvar"]}}, "plugin.device_list_strategy: duplicate"),
        ({"plugin": {"device_list_strategy": ["magic"]}}, "plugin.device_list_strategy[0]: expected one of"),
        ({"paths": {"kubelet_root": "relative/dir"}}, "paths.kubelet_root: must be an absolute path"),
        ({"debug_addr": "9477"}, "debug_addr: expected HOST:PORT, got '9477'"),
        ({"backend": "cuda"}, "backend: expected one of 'auto' | 'nvml' | 'simulated', got 'cuda'"),
        ({"cdi": {"device_plugin_kind": "nokind"}}, "cdi.device_plugin_kind: 'nokind' is not a valid CDI kind"),
        ({"cdi": {"claim_kind": "example.com/claim.v1"}}, "cdi.claim_kind: 'example.com/claim.v1': the class part"),
        ({"health": {"enabled": "perhaps"}}, "health.enabled: expected true or false, got 'perhaps'"),
        ({"dra": {"driver_name": "Not_A_Driver"}}, "dra.driver_name: 'Not_A_Driver' is not a valid DRA driver name"),
        ({"dra": {"driver_name": "a" * 64 + ".com"}}, "is not a valid DRA driver name"),
        ({"paths": {"device_plugins_dir": "dp"}}, "paths.device_plugins_dir: must be an absolute path"),
        (
            {"dra": {"publish": "sliced"}},
            "dra.publish: expected one of 'whole' | 'dynamic-mig' | 'shared' or a mapping",
        ),
        ({"dra": {"publish": 3}}, "dra.publish: expected a mapping, got 3"),
        ({"dra": {"publish": {"default": "half"}}}, "dra.publish.default: expected one of 'whole'"),
        ({"dra": {"publish": {"nodes": [{"gpus": {"0": "shared"}}]}}}, "dra.publish.nodes[0].match: name node names"),
        ({"dra": {"publish": {"nodes": [{"match": {"names": ["a"]}, "gpus": {"0": 1}}]}}}, "gpus['0']: expected one"),
        ({"dra": {"sharing": {"memory_step_mib": 0}}}, "dra.sharing.memory_step_mib: must be between 1 and 1048576"),
        ({"dra": {"sharing": {"default_memory_mib": 10**12}}}, "dra.sharing.default_memory_mib: must be between"),
        ({"dra": {"sharing": {"default_memory_mib": 1536}}}, "must be a multiple of memory_step_mib (1024)"),
        ({"dra": {"sharing": {"mps": "maybe"}}}, "dra.sharing.mps: expected true or false"),
    ],
)
def test_bad_documents_name_the_field(document: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(document)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_overrides_win_over_file() -> None:
    config = build_config(
        {"backend": "nvml", "paths": {"kubelet_root": "/a"}},
        {"backend": "simulated", "paths.kubelet_root": "/b", "debug_addr": "127.0.0.1:0"},
    )
    assert config.backend == "simulated"
    assert config.paths.kubelet_root == Path("/b")
    assert config.debug_addr == "127.0.0.1:0"


def test_env_overrides_read_gpu_agent_variables() -> None:
    env = {"GPU_AGENT_KUBELET_ROOT": "/tmp/k", "GPU_AGENT_BACKEND": "simulated", "GPU_AGENT_CDI_ROOT": "", "OTHER": "x"}
    assert env_overrides(env) == {"paths.kubelet_root": "/tmp/k", "backend": "simulated"}
    config = build_config({}, env_overrides(env))
    assert config.paths.kubelet_root == Path("/tmp/k")


def test_bad_override_names_the_field() -> None:
    with pytest.raises(ConfigError, match="backend: expected one of"):
        build_config({}, {"backend": "gpu"})


def test_read_document_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read config file .*missing\.yaml"):
        read_document(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("ownership: [unclosed\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML at line \d+"):
        read_document(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    with pytest.raises(ConfigError, match="expected a mapping at the top level"):
        read_document(scalar)


def test_load_config_version_follows_content(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("ownership: {default: dra}\n")
    first = load_config(path)
    assert first.source == str(path)
    path.write_text("ownership:\n  default: dra\n")  # same meaning, other bytes
    assert load_config(path).version == first.version
    path.write_text("ownership: {default: none}\n")
    assert load_config(path).version != first.version
    assert load_config(None).source == "defaults"


def test_plain_view_is_json_ready() -> None:
    config = build_config({"health": {"xids": {94: "count 2 within 60s"}}})
    plain = to_plain(config)
    assert plain["health"]["xids"]["94"] == "count 2 within 60s"
    assert plain["paths"]["kubelet_root"] == "/var/lib/kubelet"
    assert isinstance(config_digest(config), str)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("plugin: {time_slicing: {replicas: '²'}}\n", "plugin.time_slicing.replicas: expected an integer"),
        ("health: {history_size: " + "9" * 5000 + "}\n", "is not usable YAML"),
        ("node_labels: &x {a: *x}\n", "self-referencing YAML aliases"),
        ("health: {check_interval_s: .nan}\n", "health.check_interval_s: must be a number greater than 0"),
        ("inventory_refresh_s: .inf\n", "inventory_refresh_s: must be a number greater than 0"),
        ("health: {recovery_quiet_s: .nan}\n", "health.recovery_quiet_s: must not be negative"),
        ("plugin: {time_slicing: {replicas: 5000}}\n", "plugin.time_slicing.replicas: at most 1024"),
        ('plugin: {resource_name: "nvidia.com/gpu\\n"}\n', "is not a valid extended resource name"),
    ],
)
def test_hostile_documents_are_one_line_config_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_alias_bomb_is_refused_quickly(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    path = tmp_path / "config.yaml"
    path.write_text("node_labels:\n" + "\n".join("  " + line for line in lines) + "\n")
    with pytest.raises(ConfigError, match="too large or too deeply nested"):
        load_config(path)


def test_dra_publish_is_a_mode_or_rules_and_reloads_live() -> None:
    from agent.core.config.schema import PublishMode
    from agent.core.config.watcher import keep_restart_only

    assert build_config({"dra": {"publish": "shared"}}).dra.publish.default is PublishMode.SHARED
    rules = build_config(
        {
            "dra": {
                "publish": {
                    "default": "dynamic-mig",
                    "nodes": [{"match": {"labels": {"p": "x"}}, "gpus": {"0": "whole"}}],
                }
            }
        }
    ).dra.publish
    assert rules.default is PublishMode.DYNAMIC_MIG and rules.nodes[0].gpus == {"0": PublishMode.WHOLE}
    old = build_config({})
    new = build_config({"dra": {"publish": "shared", "driver_name": "other.example.com", "sharing": {"mps": True}}})
    kept, changed = keep_restart_only(old, new)
    assert changed == ["dra.driver_name"]  # the driver name needs a restart; the publish modes do not
    assert kept.dra.driver_name == old.dra.driver_name
    assert kept.dra.publish.default is PublishMode.SHARED and kept.dra.sharing.mps
