"""The generated deviceplugin v1beta1 code: odd betterproto names pinned, wire bytes checked.

Golden bytes are hand-built varint dumps of the field numbers in the reference; both the
betterproto classes the agent uses and the grpcio classes the tests use must produce them.
"""

from __future__ import annotations

import dataclasses

import pytest

from agent._proto.deviceplugin import v1beta1 as bp
from agent.deviceplugin.servicer import DevicePluginServicer
from tests._grpcio import deviceplugin_v1beta1_pb2 as pb


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


@pytest.mark.parametrize(
    ("cls", "names"),
    [
        (bp.Device, ["id", "health", "topology"]),
        (bp.NumaNode, ["id"]),
        (
            bp.ContainerPreferredAllocationRequest,
            ["available_device_i_ds", "must_include_device_i_ds", "allocation_size"],
        ),
        (bp.ContainerPreferredAllocationResponse, ["device_i_ds"]),
        (bp.ContainerAllocateRequest, ["devices_ids"]),
        (bp.PreStartContainerRequest, ["devices_ids"]),
        (bp.ContainerAllocateResponse, ["envs", "mounts", "devices", "annotations", "cdi_devices"]),
        (bp.RegisterRequest, ["version", "endpoint", "resource_name", "options"]),
        (bp.DevicePluginOptions, ["pre_start_required", "get_preferred_allocation_available"]),
    ],
)
def test_betterproto_attribute_names(cls: type, names: list[str]) -> None:
    assert field_names(cls) == names


def test_cdi_device_class_name() -> None:
    assert bp.CdiDevice(name="a/b=c").name == "a/b=c"


GOLDEN = [
    # Device{ID="g", health="Healthy", topology{nodes[{ID=1}]}}
    (
        bp.Device(id="g", health="Healthy", topology=bp.TopologyInfo(nodes=[bp.NumaNode(id=1)])),
        pb.Device(ID="g", health="Healthy", topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=1)])),
        b"\x0a\x01g" + b"\x12\x07Healthy" + b"\x1a\x04" + b"\x0a\x02\x08\x01",
    ),
    # ContainerPreferredAllocationRequest{available=["a","b"], must=["a"], size=2}
    (
        bp.ContainerPreferredAllocationRequest(
            available_device_i_ds=["a", "b"], must_include_device_i_ds=["a"], allocation_size=2
        ),
        pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=["a", "b"], must_include_deviceIDs=["a"], allocation_size=2
        ),
        b"\x0a\x01a\x0a\x01b" + b"\x12\x01a" + b"\x18\x02",
    ),
    (
        bp.ContainerPreferredAllocationResponse(device_i_ds=["x"]),
        pb.ContainerPreferredAllocationResponse(deviceIDs=["x"]),
        b"\x0a\x01x",
    ),
    (bp.ContainerAllocateRequest(devices_ids=["x"]), pb.ContainerAllocateRequest(devices_ids=["x"]), b"\x0a\x01x"),
    # ContainerAllocateResponse{cdi_devices=[{name="v/c=n"}]} -> field 5
    (
        bp.ContainerAllocateResponse(cdi_devices=[bp.CdiDevice(name="v/c=n")]),
        pb.ContainerAllocateResponse(cdi_devices=[pb.CDIDevice(name="v/c=n")]),
        b"\x2a\x07" + b"\x0a\x05v/c=n",
    ),
    # RegisterRequest{version, endpoint, resource_name, options{get_preferred=true}}
    (
        bp.RegisterRequest(
            version="v1beta1",
            endpoint="e.sock",
            resource_name="a/b",
            options=bp.DevicePluginOptions(get_preferred_allocation_available=True),
        ),
        pb.RegisterRequest(
            version="v1beta1",
            endpoint="e.sock",
            resource_name="a/b",
            options=pb.DevicePluginOptions(get_preferred_allocation_available=True),
        ),
        b"\x0a\x07v1beta1" + b"\x12\x06e.sock" + b"\x1a\x03a/b" + b"\x22\x02\x10\x01",
    ),
]


@pytest.mark.parametrize(("ours", "theirs", "wire"), GOLDEN)
def test_golden_bytes(ours: object, theirs: object, wire: bytes) -> None:
    assert bytes(ours) == wire  # type: ignore[call-overload]
    assert theirs.SerializeToString() == wire  # type: ignore[attr-defined]
    assert type(ours)().parse(wire) == ours  # type: ignore[attr-defined]


def test_servicer_exposes_exactly_the_five_paths() -> None:
    paths = set(DevicePluginServicer.__mapping__(object.__new__(DevicePluginServicer)))  # type: ignore[arg-type]
    assert paths == {
        "/v1beta1.DevicePlugin/GetDevicePluginOptions",
        "/v1beta1.DevicePlugin/ListAndWatch",
        "/v1beta1.DevicePlugin/GetPreferredAllocation",
        "/v1beta1.DevicePlugin/Allocate",
        "/v1beta1.DevicePlugin/PreStartContainer",
    }
    assert pb.DESCRIPTOR.package == "v1beta1"
    assert pb.DESCRIPTOR.services_by_name["Registration"].full_name == "v1beta1.Registration"
