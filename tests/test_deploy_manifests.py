"""Every kustomization under config/ renders with kubectl and validates offline against the
Kubernetes OpenAPI schemas (kubernetes-validate) of each version the project supports, and the
rendered agent manifests agree with the agent: image version, driver name, ServiceAccount, config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

import agent
from agent.core.config.loader import build_config
from agent.core.config.schema import DEFAULT_DRA_DRIVER, Config
from tests.manifests import AGENT_KUSTOMIZATIONS, KUSTOMIZATIONS, agent_container, only, render

#: the agent's manifests (DaemonSet, RBAC, admission policy v1) need nothing newer than this;
#: 1.32 is the oldest release with DRA in beta
OLDEST_AGENT_VERSION = "1.32"
#: resource.k8s.io/v1 (DeviceClasses, ResourceClaimTemplates) is served from 1.34
FIRST_V1_DRA_VERSION = "1.34"
NEWEST_VERSION = kubernetes_validate.latest_version()


def test_the_tree_has_every_kustomization_the_readme_names() -> None:
    assert KUSTOMIZATIONS == [
        "config/base",
        "config/deviceclasses",
        "config/deviceclasses/extended-resource",
        "config/examples",
        "config/overlays/kind-simulated",
        "config/overlays/nvml-driver-container",
        "config/overlays/nvml-host",
    ]


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_kustomization_renders(directory: str) -> None:
    objects = render(directory)
    assert objects
    for obj in objects:
        assert obj["apiVersion"] and obj["kind"] and obj["metadata"]["name"]


def _validate_all(objects: list[dict[str, Any]], version: str) -> None:
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']} on Kubernetes {version}"
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.path)
            pytest.fail(f"{where}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            pytest.fail(f"{where}: no schema: {exc.message}")


def _versions(directory: str) -> list[str]:
    first = OLDEST_AGENT_VERSION if directory in AGENT_KUSTOMIZATIONS else FIRST_V1_DRA_VERSION
    return sorted({first, FIRST_V1_DRA_VERSION, NEWEST_VERSION}, key=lambda v: tuple(map(int, v.split("."))))


@pytest.mark.parametrize(
    ("directory", "version"), [(d, v) for d in KUSTOMIZATIONS for v in _versions(d)], ids=lambda x: str(x)
)
def test_rendered_objects_validate_against_the_openapi_schema(directory: str, version: str) -> None:
    _validate_all(render(directory), version)


@pytest.mark.parametrize("directory", ["config/deviceclasses", "config/examples"])
def test_dra_objects_need_resource_k8s_io_v1(directory: str) -> None:
    # the version floor docs/operating.md states: before 1.34 there is no resource.k8s.io/v1 to validate against
    dra = [o for o in render(directory) if o["apiVersion"] == "resource.k8s.io/v1"]
    assert dra
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(dra[0], "1.33", strict=True)


def test_a_schema_violation_is_reported() -> None:
    daemonset = only(render("config/overlays/nvml-host"), "DaemonSet")
    daemonset["spec"]["template"]["spec"]["hostNetwork"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, NEWEST_VERSION, strict=True)


@pytest.mark.parametrize("directory", [d for d in AGENT_KUSTOMIZATIONS if d != "config/base"])
def test_overlays_run_the_image_of_this_version(directory: str) -> None:
    objects = render(directory)
    pod = only(objects, "DaemonSet")["spec"]["template"]["spec"]
    images = {c["image"] for c in pod["containers"] + pod.get("initContainers", [])}
    assert images == {f"gpu-node-agent:{agent.__version__}"}


def test_dockerfile_labels_this_version() -> None:
    dockerfile = (Path(__file__).resolve().parents[1] / "container" / "Dockerfile").read_text()
    assert f"ARG VERSION={agent.__version__}\n" in dockerfile


@pytest.mark.parametrize("directory", AGENT_KUSTOMIZATIONS)
def test_configmap_holds_a_valid_config_under_the_mounted_name(directory: str) -> None:
    objects = render(directory)
    configmap = only(objects, "ConfigMap")
    daemonset = only(objects, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if "configMap" in v)
    assert volume["configMap"]["name"] == configmap["metadata"]["name"] == "gpu-node-agent"
    assert configmap["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    env = {e["name"]: e.get("value") for e in agent_container(daemonset)["env"]}
    file_name = Path(env["GPU_AGENT_CONFIG"]).name
    config = build_config(yaml.safe_load(configmap["data"][file_name]) or {})
    assert config.dra.driver_name == DEFAULT_DRA_DRIVER


@pytest.mark.parametrize("directory", AGENT_KUSTOMIZATIONS)
def test_admission_policy_names_the_agents_serviceaccount_and_driver(directory: str) -> None:
    objects = render(directory)
    account = only(objects, "ServiceAccount")["metadata"]
    daemonset = only(objects, "DaemonSet")
    assert daemonset["spec"]["template"]["spec"]["serviceAccountName"] == account["name"]
    assert daemonset["metadata"]["namespace"] == account["namespace"]
    policies = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"}
    assert set(policies) == {"gpu-node-agent-resourceslices", "gpu-node-agent-node-status"}
    user = f"system:serviceaccount:{account['namespace']}:{account['name']}"
    for policy in policies.values():
        expressions = [c["expression"] for c in policy["spec"]["matchConditions"]]
        assert expressions == [f'request.userInfo.username == "{user}"']
    validations = policies["gpu-node-agent-resourceslices"]["spec"]["validations"]
    driver_checks = [v["expression"] for v in validations if "spec.driver" in v["expression"]]
    assert driver_checks == [f'variables.slice.spec.driver == "{Config().dra.driver_name}"']
    # the resources the agent may lower are those of its resource name's domain
    (ours,) = (v for v in policies["gpu-node-agent-node-status"]["spec"]["variables"] if v["name"] == "ours")
    assert ours["expression"] == f'"{Config().plugin.resource_name.partition("/")[0]}/"'
    bindings = {o["spec"]["policyName"]: o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"}
    assert set(bindings) == set(policies)
    assert all(b["spec"]["validationActions"] == ["Deny"] for b in bindings.values())


@pytest.mark.parametrize("directory", AGENT_KUSTOMIZATIONS)
def test_rbac_grants_exactly_what_the_agent_uses(directory: str) -> None:
    objects = render(directory)
    account = only(objects, "ServiceAccount")["metadata"]
    subject = {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}
    grants: set[tuple[str, str, str, str]] = set()  # (namespace or *, group, resource, verb)
    for binding in (o for o in objects if o["kind"] in ("ClusterRoleBinding", "RoleBinding")):
        assert binding["subjects"] == [subject]
        role = next(
            o
            for o in objects
            if o["kind"] == binding["roleRef"]["kind"] and o["metadata"]["name"] == binding["roleRef"]["name"]
        )
        scope = binding["metadata"].get("namespace", "*")
        for rule in role["rules"]:
            assert "resourceNames" not in rule and "nonResourceURLs" not in rule
            grants |= {(scope, g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    slice_verbs = ("get", "list", "watch", "create", "update", "patch", "delete")
    assert grants == (
        {("*", "", "nodes", v) for v in ("get", "list", "watch")}
        | {("*", "", "nodes/status", "patch")}  # lowering its own counts (admission-policy.yaml)
        | {("*", "resource.k8s.io", "resourceslices", v) for v in slice_verbs}
        | {("*", "resource.k8s.io", "resourceclaims", "get")}
        | {("default", "", "events", v) for v in ("create", "patch")}  # a repeat counts into its Event
        # the orphan check: the node's pods are watched, one that went away is read once
        | {("*", "", "pods", v) for v in ("get", "list", "watch")}
    )


@pytest.mark.parametrize("directory", AGENT_KUSTOMIZATIONS)
def test_namespace_admits_a_privileged_node_agent(directory: str) -> None:
    objects = render(directory)
    namespace = only(objects, "Namespace")
    assert namespace["metadata"]["name"] == only(objects, "DaemonSet")["metadata"]["namespace"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
