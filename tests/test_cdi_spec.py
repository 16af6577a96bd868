"""Spec model: name rules, validation, minimum version, strict parsing, serialisation."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.cdi import names
from agent.cdi import spec as s
from agent.cdi.errors import InvalidNameError, InvalidSpecError

NODE = s.DeviceNode(path="/dev/nvidia0")
EDITS = s.ContainerEdits(device_nodes=(NODE,))


def spec_with(
    *, name: str = "gpu0", edits: s.ContainerEdits = EDITS, kind: str = "example.com/gpu", **kw: object
) -> s.Spec:
    return s.Spec(version="0.3.0", kind=kind, devices=(s.Device(name=name, container_edits=edits),), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("gpu0", True),
        ("0", True),
        ("GPU-1b2c-3d", True),
        ("1:0", True),
        ("a_b.c", True),
        ("-a", False),
        ("a-", False),
        ("a b", False),
        ("a/b", False),
        ("", False),
        ("all", True),
    ],
)
def test_device_name_rule(name: str, ok: bool) -> None:
    assert (names.device_name_problem(name) is None) is ok


@pytest.mark.parametrize(
    ("kind", "ok"),
    [
        ("k8s.gpu-node-agent.nvidia.com/gpu", True),
        ("nvidia.com/gpu", True),
        ("vendor/class_1", True),
        ("1vendor/gpu", False),
        ("vendor/gpu-", False),
        ("vendor", False),
        ("vendor/", False),
        ("ven dor/gpu", False),
    ],
)
def test_kind_rule(kind: str, ok: bool) -> None:
    if ok:
        names.split_kind(kind)
    else:
        with pytest.raises(InvalidNameError):
            names.split_kind(kind)


def test_qualified_names() -> None:
    q = names.qualified_name("k8s.gpu-node-agent.nvidia.com/gpu", "GPU-1")
    assert q == "k8s.gpu-node-agent.nvidia.com/gpu=GPU-1"
    for kind, name in (("/dev/nvidia0", "x"), ("vendor", "x"), ("vendor/gpu", ""), ("vendor/gpu", "a b")):
        with pytest.raises(InvalidNameError):
            names.qualified_name(kind, name)


def test_file_names_and_claim_uids() -> None:
    kind = "k8s.gpu-node-agent.nvidia.com/claim"
    assert names.spec_file_name(kind) == "k8s.gpu-node-agent.nvidia.com-claim.json"
    uid = "0e3f1a2b-aaaa-bbbb-cccc-000000000001"
    file_name = names.transient_spec_file_name(kind, uid)
    assert file_name == f"k8s.gpu-node-agent.nvidia.com-claim_{uid}.json"
    assert names.claim_uid_of(kind, file_name) == uid
    assert names.claim_uid_of(kind, "k8s.gpu-node-agent.nvidia.com-gpu.json") is None
    assert names.claim_device_name(uid, "MIG-GPU-1/2/0") == f"{uid}-MIG-GPU-1_2_0"
    for bad in ("", "a/b", "../x", "a b", "a:b", "-x", "x" * 200):
        with pytest.raises(InvalidNameError):
            names.check_claim_uid(bad)


@given(st.text(alphabet="abcXYZ019_.:-/ ", max_size=12))
def test_device_part_always_makes_a_name_when_alnum_at_ends(raw: str) -> None:
    part = names.device_part(raw)
    assert "/" not in part and " " not in part
    if part and part[0].isalnum() and part[-1].isalnum():
        assert names.device_name_problem(part) is None


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: spec_with(), "0.3.0"),
        (lambda: spec_with(edits=s.ContainerEdits(mounts=(s.Mount("/a", "/b", type="bind"),))), "0.4.0"),
        (lambda: spec_with(edits=s.ContainerEdits(device_nodes=(s.DeviceNode("/dev/x", host_path="/h/x"),))), "0.5.0"),
        (lambda: spec_with(name="0"), "0.5.0"),
        (lambda: spec_with(annotations={"a": "b"}), "0.6.0"),
        (lambda: spec_with(kind="example.com/gpu.x"), "0.6.0"),
        (lambda: spec_with(edits=s.ContainerEdits(additional_gids=(44,))), "0.7.0"),
        (lambda: spec_with(edits=s.ContainerEdits(intel_rdt=s.IntelRdt(clos_id="c"))), "0.7.0"),
        (lambda: spec_with(edits=s.ContainerEdits(net_devices=(s.NetDevice("eth1", "net0"),))), "1.1.0"),
    ],
)
def test_minimum_version(build: object, expected: str) -> None:
    spec = build()  # type: ignore[operator]
    assert s.minimum_version(spec) == expected
    assert s.validate(dataclasses.replace(spec, version=expected)) == []


def test_declared_version_below_minimum_is_rejected() -> None:
    problems = s.validate(spec_with(name="0"))
    assert problems == ["cdiVersion: the spec version must be at least v0.5.0 for the fields used"]


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (spec_with(edits=s.ContainerEdits()), "empty device edits"),
        (spec_with(edits=s.ContainerEdits(env=("NOEQUALS",))), "invalid environment variable"),
        (spec_with(edits=s.ContainerEdits(env=("=x",))), "invalid environment variable"),
        (spec_with(edits=s.ContainerEdits(device_nodes=(s.DeviceNode("dev/x"),))), "absolute path"),
        (spec_with(edits=s.ContainerEdits(device_nodes=(s.DeviceNode("/dev/x", type="x"),))), "type"),
        (spec_with(edits=s.ContainerEdits(device_nodes=(s.DeviceNode("/dev/x", permissions="rwx"),))), "permissions"),
        (spec_with(edits=s.ContainerEdits(hooks=(s.Hook("preStart", "/bin/true"),))), "unknown hook"),
        (spec_with(edits=s.ContainerEdits(hooks=(s.Hook("poststop", "true"),))), "absolute path"),
        (spec_with(edits=s.ContainerEdits(hooks=(s.Hook("poststop", "/bin/true", env=("X",)),))), "environment"),
        (spec_with(edits=s.ContainerEdits(mounts=(s.Mount("", "/b"),))), "must not be empty"),
        (spec_with(edits=s.ContainerEdits(mounts=(s.Mount("/a", "b"),))), "absolute path"),
        (spec_with(name="bad name"), "invalid device name"),
        (spec_with(kind="nope"), "kind"),
        (s.Spec(version="0.3.0", kind="example.com/gpu", devices=()), "at least one device"),
        (s.Spec(version="0.9.9", kind="example.com/gpu", devices=spec_with().devices), "unknown version"),
    ],
)
def test_validation_rejects(spec: s.Spec, fragment: str) -> None:
    problems = s.validate(spec)
    assert any(fragment in p for p in problems), problems
    with pytest.raises(InvalidSpecError):
        s.check(spec)


def test_duplicate_device_names_rejected() -> None:
    device = s.Device(name="a", container_edits=EDITS)
    problems = s.validate(s.Spec(version="0.3.0", kind="example.com/gpu", devices=(device, device)))
    assert any("duplicate device name" in p for p in problems)


def test_round_trip_and_omitted_empty_fields() -> None:
    edits = s.ContainerEdits(
        env=("A=1",),
        device_nodes=(s.DeviceNode("/dev/nvidia0", host_path="/r/dev/nvidia0", type="c", major=195, minor=0),),
        mounts=(s.Mount("/h/lib", "/c/lib", options=("ro", "rbind")),),
        hooks=(s.Hook("createContainer", "/usr/bin/nvidia-cdi-hook", args=("nvidia-cdi-hook", "update-ldcache")),),
    )
    spec = s.Spec.at_minimum_version(kind="example.com/gpu", devices=(s.Device("0", edits),))
    text = s.dumps(spec)
    doc = json.loads(text)
    assert list(doc) == ["cdiVersion", "kind", "devices"]
    assert doc["cdiVersion"] == "0.5.0"
    assert doc["devices"][0]["containerEdits"]["deviceNodes"][0]["minor"] == 0
    assert s.loads(text) == spec
    assert s.loads(text.replace('"cdiVersion"', '"cdiVersion"'), yaml_format=True) == spec  # JSON is YAML


@pytest.mark.parametrize(
    "text",
    [
        '{"cdiVersion": "0.3.0", "kind": "a/b", "devices": [], "extra": 1}',
        '{"cdiVersion": "0.3.0", "kind": "a/b", "devices": [{"name": "x", "containerEdits": {"envs": []}}]}',
        '{"cdiVersion": "0.3.0", "kind": "a/b", "devices": [{"name": 1, "containerEdits": {}}]}',
        '{"kind": "a/b", "devices": []}',
        "[]",
        "",
        "{not json",
    ],
)
def test_strict_parsing(text: str) -> None:
    with pytest.raises(InvalidSpecError):
        s.loads(text)
