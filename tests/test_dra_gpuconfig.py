"""The opaque GpuConfig: strict parsing with the field named, and class-then-claim precedence."""

from __future__ import annotations

from typing import Any

import pytest

from agent.dra.claims.errors import ClaimError, Reason
from agent.dra.claims.gpuconfig import MAX_ENV, driver_configs, env_for, parse_gpu_config
from tests.dra_fakes import DRIVER, gpu_config, opaque


def test_a_minimal_config_is_empty() -> None:
    config = parse_gpu_config({"apiVersion": "gpu-node-agent.nvidia.com/v1alpha1", "kind": "GpuConfig"}, "c")
    assert dict(config.env) == {}


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({**gpu_config(), "timeSlicing": {}}, "c: unknown field 'timeSlicing' (GpuConfig has apiVersion, kind, env)"),
        ({"kind": "GpuConfig"}, "c: apiVersion: unsupported None"),
        ({**gpu_config(), "kind": "gpuconfig"}, "c: kind: unsupported 'gpuconfig'"),
        (gpu_config(["A=1"]), "c: env: must be an object"),  # type: ignore[arg-type]
        (gpu_config({"A": 1}), "c: env.A: value must be a string, got int"),
        (gpu_config({"A-B": "x"}), "invalid variable name 'A-B'"),
        (gpu_config({"GPU_AGENT_SIMULATED": "x"}), "env.GPU_AGENT_SIMULATED: reserved for the driver"),
        (gpu_config({"CUDA_VISIBLE_DEVICES": "0"}), "reserved for the driver"),
        (gpu_config({f"V{i}": "x" for i in range(MAX_ENV + 1)}), f"{MAX_ENV + 1} variables, at most {MAX_ENV}"),
        (gpu_config({"A": "x" * 5000}), "longer than 4096"),
        (gpu_config({"A": "a\x00b"}), "NUL byte"),
        ({**gpu_config(), "pad": "x" * 20000}, "bytes, at most 16384"),
        ("a string", "parameters must be an object, got str"),
    ],
)
def test_every_problem_names_the_field(parameters: Any, message: str) -> None:
    with pytest.raises(ClaimError) as err:
        parse_gpu_config(parameters, "c")
    assert message in str(err.value) and err.value.reason is Reason.BAD_CONFIG
    assert not err.value.recoverable


def test_long_untrusted_values_are_quoted_short() -> None:
    with pytest.raises(ClaimError) as err:
        parse_gpu_config({**gpu_config(), "kind": "K" * 1000}, "c")
    assert len(str(err.value)) < 200


def test_class_configs_apply_before_claim_configs_and_requests_scope_them() -> None:
    configs = driver_configs(
        [
            opaque(gpu_config({"A": "claim", "C": "claim"}), source="FromClaim"),
            opaque(gpu_config({"A": "class", "B": "class"}), source="FromClass"),
            opaque(gpu_config({"D": "main"}), requests=["main"]),
            opaque(gpu_config({"E": "sub"}), requests=["main/sub"]),
            opaque({"not": "ours"}, driver="gpu.nvidia.com"),
        ],
        DRIVER,
    )
    assert env_for(configs, "other") == {"A": "claim", "B": "class", "C": "claim"}
    assert env_for(configs, "main") == {"A": "claim", "B": "class", "C": "claim", "D": "main"}
    assert env_for(configs, "main/sub") == {"A": "claim", "B": "class", "C": "claim", "D": "main", "E": "sub"}
    assert env_for(configs, "main/other") == {"A": "claim", "B": "class", "C": "claim", "D": "main"}


def test_the_error_says_which_config_is_wrong() -> None:
    with pytest.raises(ClaimError, match=r"opaque config #1 \(FromClass\): unknown field 'x'"):
        driver_configs([opaque(gpu_config()), opaque({**gpu_config(), "x": 1}, source="FromClass")], DRIVER)
