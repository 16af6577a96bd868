"""Wire facts of the generated DRA, health and registration code, checked in golden bytes.

betterproto (what the agent runs) and grpcio's protobuf (the kubelet side in tests) must
agree byte for byte, including proto3 ``optional`` explicit presence of ``share_id``.
"""

from __future__ import annotations

import pytest

from agent._proto.dra_v1.k8s.io.kubelet.pkg.apis.dra import v1 as bp_v1
from agent._proto.dra_v1beta1.k8s.io.kubelet.pkg.apis.dra import v1beta1 as bp_v1beta1
from agent._proto.drahealth_v1alpha1 import v1alpha1 as bp_health
from agent._proto.pluginregistration import pluginregistration as bp_reg
from tests._grpcio import dra_v1_pb2, dra_v1beta1_pb2, drahealth_v1alpha1_pb2, pluginregistration_v1_pb2

# Device{pool_name="p"(2), device_name="d"(3)}
BASE = bytes.fromhex("1201701a0164")


def test_share_id_absent_is_not_on_the_wire() -> None:
    assert bytes(bp_v1.Device(pool_name="p", device_name="d")) == BASE
    parsed = bp_v1.Device().parse(BASE)
    assert parsed.share_id is None
    assert not dra_v1_pb2.Device.FromString(BASE).HasField("share_id")


@pytest.mark.parametrize("share_id", ["", "a1b2"])
def test_share_id_present_even_when_empty(share_id: str) -> None:
    golden = BASE + bytes([0x2A, len(share_id)]) + share_id.encode()
    assert bytes(bp_v1.Device(pool_name="p", device_name="d", share_id=share_id)) == golden
    assert bp_v1.Device().parse(golden).share_id == share_id
    theirs = dra_v1_pb2.Device(pool_name="p", device_name="d", share_id=share_id)
    assert theirs.SerializeToString() == golden and theirs.HasField("share_id")


def test_v1beta1_device_has_no_share_id_and_skips_it() -> None:
    assert "share_id" not in bp_v1beta1.Device.__dataclass_fields__
    with_share = BASE + bytes.fromhex("2a00")
    # an old peer reading a v1 Device ignores field 5
    assert dra_v1beta1_pb2.Device.FromString(with_share).device_name == "d"


def test_prepare_response_map_keyed_by_claim_uid() -> None:
    ours = bp_v1.NodePrepareResourcesResponse(
        claims={
            "uid-1": bp_v1.NodePrepareResourceResponse(
                devices=[
                    bp_v1.Device(request_names=["gpu"], pool_name="n", device_name="gpu-0", cdi_device_ids=["k/c=x"])
                ]
            ),
            "uid-2": bp_v1.NodePrepareResourceResponse(error="boom"),
        }
    )
    theirs = dra_v1_pb2.NodePrepareResourcesResponse.FromString(bytes(ours))
    assert set(theirs.claims) == {"uid-1", "uid-2"}
    device = theirs.claims["uid-1"].devices[0]
    assert (list(device.request_names), device.pool_name, device.device_name) == (["gpu"], "n", "gpu-0")
    assert list(device.cdi_device_ids) == ["k/c=x"] and not device.HasField("share_id")
    assert theirs.claims["uid-2"].error == "boom"
    # the same bytes through v1beta1 (the kubelet converts the two versions 1:1)
    assert bytes(bp_v1beta1.NodePrepareResourcesResponse().parse(bytes(ours))) == bytes(ours)


def test_claim_fields() -> None:
    golden = dra_v1_pb2.Claim(namespace="ns", uid="u", name="n").SerializeToString()
    assert golden == bytes.fromhex("0a026e73120175") + bytes.fromhex("1a016e")
    claim = bp_v1.Claim().parse(golden)
    assert (claim.namespace, claim.uid, claim.name) == ("ns", "u", "n")


def test_health_device_fields_4_and_5() -> None:
    ours = bp_health.DeviceHealth(
        device=bp_health.DeviceIdentifier(pool_name="n", device_name="gpu-0"),
        health=bp_health.HealthStatus.UNHEALTHY,
        last_updated_time=1700000000,
        health_check_timeout_seconds=45,
        message="xid 79",
    )
    theirs = drahealth_v1alpha1_pb2.DeviceHealth.FromString(bytes(ours))
    assert theirs.health == drahealth_v1alpha1_pb2.UNHEALTHY == 2
    assert (theirs.last_updated_time, theirs.health_check_timeout_seconds, theirs.message) == (1700000000, 45, "xid 79")
    assert (theirs.device.pool_name, theirs.device.device_name) == ("n", "gpu-0")
    assert bytes(ours) == theirs.SerializeToString()


def test_wire_service_names() -> None:
    assert dra_v1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"].full_name == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    assert (
        dra_v1beta1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"].full_name
        == "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
    )
    health = drahealth_v1alpha1_pb2.DESCRIPTOR.services_by_name["DRAResourceHealth"]
    assert health.full_name == "v1alpha1.DRAResourceHealth"
    reg = pluginregistration_v1_pb2.DESCRIPTOR.services_by_name["Registration"]
    assert reg.full_name == "pluginregistration.Registration"
    info = bp_reg.PluginInfo(type="DRAPlugin", name="d", endpoint="/e", supported_versions=["v1.DRAPlugin"])
    assert pluginregistration_v1_pb2.PluginInfo.FromString(bytes(info)).supported_versions == ["v1.DRAPlugin"]
