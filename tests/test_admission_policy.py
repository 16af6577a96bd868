"""The ValidatingAdmissionPolicy confines the agent's ResourceSlice writes to its own node and
driver: its CEL is evaluated here with cel-python the way the API server applies it (match
conditions, then variables in order, then every validation). A real API server's verdict
(server-side dry run) is the deployment check this stands in for."""

from __future__ import annotations

from typing import Any

import pytest

from agent.core.config.schema import DEFAULT_DRA_DRIVER
from tests.cel_eval import ADMISSION_POLICY, compile_expression, to_cel
from tests.manifests import only, render

AGENT = "system:serviceaccount:gpu-node-agent:gpu-node-agent"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


def _policy() -> dict[str, Any]:
    return only(render("config/base"), "ValidatingAdmissionPolicy")


def _slice(node: str | None, driver: str = DEFAULT_DRA_DRIVER) -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": driver, "pool": {"name": node or "all", "generation": 1, "resourceSliceCount": 1}}
    if node is None:
        spec["allNodes"] = True
    else:
        spec["nodeName"] = node
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "s"}, "spec": spec}


def _admit(
    operation: str, user: str, token_node: str | None, new: dict[str, Any] | None, old: dict[str, Any] | None
) -> list[str] | None:
    """None: the policy does not apply; otherwise the denial messages (empty: allowed)."""
    spec = _policy()["spec"]
    user_info: dict[str, Any] = {"username": user}
    if token_node is not None:
        user_info["extra"] = {NODE_NAME_EXTRA: [token_node]}
    activation: dict[str, Any] = {
        "request": to_cel({"operation": operation, "userInfo": user_info}),
        "object": to_cel(new),
        "oldObject": to_cel(old),
    }
    for condition in spec["matchConditions"]:
        if not compile_expression(condition["expression"], ADMISSION_POLICY).evaluate(activation):
            return None
    variables: dict[str, Any] = {}
    for variable in spec["variables"]:
        activation["variables"] = to_cel(variables)
        variables[variable["name"]] = compile_expression(variable["expression"], ADMISSION_POLICY).evaluate(activation)
    activation["variables"] = to_cel(variables)
    denials = []
    for validation in spec["validations"]:
        if not compile_expression(validation["expression"], ADMISSION_POLICY).evaluate(activation):
            if "messageExpression" in validation:
                message = compile_expression(validation["messageExpression"], ADMISSION_POLICY).evaluate(activation)
            else:
                message = validation["message"]
            denials.append(str(message))
    return denials


def test_policy_matches_every_write_to_resourceslices() -> None:
    spec = _policy()["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule == {
        "apiGroups": ["resource.k8s.io"],
        "apiVersions": ["*"],
        "operations": ["CREATE", "UPDATE", "DELETE"],
        "resources": ["resourceslices"],
    }


@pytest.mark.parametrize(
    ("operation", "new", "old"),
    [
        ("CREATE", _slice("node-a"), None),
        ("UPDATE", _slice("node-a"), _slice("node-a")),
        ("DELETE", None, _slice("node-a")),
    ],
)
def test_agent_may_write_its_own_nodes_slices(operation: str, new: Any, old: Any) -> None:
    assert _admit(operation, AGENT, "node-a", new, old) == []


@pytest.mark.parametrize(
    ("operation", "new", "old", "denied"),
    [
        ("CREATE", _slice("node-b"), None, "may write only ResourceSlices with spec.nodeName node-a"),
        ("UPDATE", _slice("node-b"), _slice("node-b"), "spec.nodeName node-a"),
        ("DELETE", None, _slice("node-b"), "spec.nodeName node-a"),
        ("CREATE", _slice(None), None, "spec.nodeName node-a"),
        ("CREATE", _slice("node-a", driver="gpu.nvidia.com"), None, f"of its driver {DEFAULT_DRA_DRIVER}"),
        ("DELETE", None, _slice("node-a", driver="gpu.nvidia.com"), f"of its driver {DEFAULT_DRA_DRIVER}"),
    ],
)
def test_agent_may_not_write_other_nodes_or_drivers_slices(operation: str, new: Any, old: Any, denied: str) -> None:
    denials = _admit(operation, AGENT, "node-a", new, old)
    assert denials is not None and any(denied in d for d in denials), denials


def test_token_without_a_node_may_not_write() -> None:
    denials = _admit("CREATE", AGENT, None, _slice("node-a"), None)
    assert denials is not None and any("pod-bound" in d for d in denials)


@pytest.mark.parametrize("user", ["system:node:node-b", "system:serviceaccount:gpu-operator:nvidia-dra-driver"])
def test_policy_leaves_other_users_alone(user: str) -> None:
    assert _admit("CREATE", user, "node-a", _slice("node-b"), None) is None
