"""The ValidatingAdmissionPolicies confine the agent's ResourceSlice writes to its own node and
driver, and its Node status patches to lowering its own resources' counts on its own Node: their
CEL is evaluated here with cel-python the way the API server applies it (match conditions, then
variables in order, then every validation). A real API server's verdict (server-side dry run) is
the deployment check this stands in for."""

from __future__ import annotations

from typing import Any

import pytest

from agent.core.config.schema import DEFAULT_DRA_DRIVER
from tests.cel_eval import ADMISSION_POLICY, compile_expression, to_cel
from tests.manifests import render

AGENT = "system:serviceaccount:gpu-node-agent:gpu-node-agent"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


SLICES = "gpu-node-agent-resourceslices"
NODE_STATUS = "gpu-node-agent-node-status"


def _policy(name: str = SLICES) -> dict[str, Any]:
    (policy,) = (
        o for o in render("config/base") if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"] == name
    )
    return policy


def _slice(node: str | None, driver: str = DEFAULT_DRA_DRIVER) -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": driver, "pool": {"name": node or "all", "generation": 1, "resourceSliceCount": 1}}
    if node is None:
        spec["allNodes"] = True
    else:
        spec["nodeName"] = node
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "s"}, "spec": spec}


def _admit(
    operation: str,
    user: str,
    token_node: str | None,
    new: dict[str, Any] | None,
    old: dict[str, Any] | None,
    policy: str = SLICES,
) -> list[str] | None:
    """None: the policy does not apply; otherwise the denial messages (empty: allowed)."""
    spec = _policy(policy)["spec"]
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


# --- nodes/status: only lower its own resources' counts, on its own Node ---------------------


def _node(name: str = "node-a", **changes: Any) -> dict[str, Any]:
    """A Node as the kubelet keeps it; ``changes`` replace top-level parts of its status."""
    status: dict[str, Any] = {
        "capacity": {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "8", "nvidia.com/mig-1g.10gb": "2"},
        "allocatable": {"cpu": "15500m", "memory": "63Gi", "nvidia.com/gpu": "8", "nvidia.com/mig-1g.10gb": "2"},
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
        "addresses": [{"type": "Hostname", "address": name}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
        "nodeInfo": {"kubeletVersion": "v1.36.2", "machineID": "m"},
    }
    status.update(changes)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"pool": "a100"}, "annotations": {"a": "b"}},
        "status": status,
    }


def _lowered(**counts: str) -> dict[str, Any]:
    node = _node()
    for field in ("capacity", "allocatable"):
        node["status"][field].update(counts)
    return node


def _patch(
    new: dict[str, Any], old: dict[str, Any] | None = None, token_node: str | None = "node-a"
) -> list[str] | None:
    return _admit("UPDATE", AGENT, token_node, new, old or _node(new["metadata"]["name"]), policy=NODE_STATUS)


def test_node_status_policy_matches_status_updates_only() -> None:
    spec = _policy(NODE_STATUS)["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule == {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["nodes/status"]}


@pytest.mark.parametrize(
    "new",
    [
        _lowered(**{"nvidia.com/gpu": "4"}),
        _lowered(**{"nvidia.com/gpu": "0", "nvidia.com/mig-1g.10gb": "1"}),
        _node(),  # a patch that changes nothing
    ],
)
def test_agent_may_lower_its_own_resources_on_its_own_node(new: dict[str, Any]) -> None:
    assert _patch(new) == []


def test_capacity_and_allocatable_are_checked_each() -> None:
    new = _node()
    new["status"]["allocatable"]["nvidia.com/gpu"] = "3"  # allocatable lowered, capacity kept
    assert _patch(new) == []


@pytest.mark.parametrize(
    ("new", "denied"),
    [
        (_lowered(**{"nvidia.com/gpu": "9"}), "may only lower"),
        (_lowered(cpu="8"), "may only lower"),
        (_lowered(**{"example.com/fpga": "0"}), "may only lower"),  # a key added
        (_node(capacity={"cpu": "16"}), "may only lower"),  # keys removed
        (_lowered(**{"nvidia.com/new": "0"}), "may only lower"),  # a key of ours added
        (_node(conditions=[{"type": "Ready", "status": "False", "reason": "Agent"}]), "may change nothing"),
        (_node(addresses=[]), "may change nothing"),
        (_node(phase="Terminated"), "may change nothing"),
    ],
)
def test_agent_may_change_nothing_else_in_the_status(new: dict[str, Any], denied: str) -> None:
    denials = _patch(new)
    assert denials is not None and any(denied in d for d in denials), denials


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m["labels"].update(pool="dra"),
        lambda m: m.pop("annotations"),
        lambda m: m.update(finalizers=["x"]),
        lambda m: m.update(ownerReferences=[{"kind": "Machine", "name": "m", "uid": "u", "apiVersion": "v1"}]),
    ],
)
def test_agent_may_not_touch_its_nodes_metadata_through_the_status(change: Any) -> None:
    new = _lowered(**{"nvidia.com/gpu": "4"})
    change(new["metadata"])
    denials = _patch(new)
    assert denials is not None and any("labels, annotations, finalizers or owners" in d for d in denials), denials


def test_agent_may_not_patch_another_nodes_status() -> None:
    new = _node("node-b")
    new["status"]["allocatable"]["nvidia.com/gpu"] = "0"
    denials = _patch(new)
    assert denials is not None and any("may patch the status of Node node-a only" in d for d in denials), denials


def test_a_token_without_a_node_may_not_patch_a_node_status() -> None:
    denials = _patch(_lowered(**{"nvidia.com/gpu": "4"}), token_node=None)
    assert denials is not None and any("pod-bound" in d for d in denials)


def test_node_status_policy_leaves_the_kubelet_alone() -> None:
    new = _lowered(**{"nvidia.com/gpu": "9"})
    assert _admit("UPDATE", "system:node:node-a", None, new, _node(), policy=NODE_STATUS) is None
