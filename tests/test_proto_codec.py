"""The compiled protobuf codec (betterproto-rust-codec) the agent runs with: in use, and safe on any bytes.

betterproto replaces ``Message.parse``/``__bytes__`` with the Rust codec when it is importable.
Peers send the agent bytes it decodes with it, so whatever they send must come back as a
parsed message or an ordinary ``Exception`` (grpclib answers that with a status): a Rust panic
surfaces in Python as ``BaseException``, which would escape every handler and stop the loop.
"""

from __future__ import annotations

import contextlib

import betterproto
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent._proto.deviceplugin import v1beta1 as dp
from agent._proto.dra_v1.k8s.io.kubelet.pkg.apis.dra import v1 as dra
from agent._proto.pluginregistration import pluginregistration as reg
from agent._proto.podresources_v1 import v1 as pr

#: what the agent decodes from a peer (kubelet requests; PodResources and registration answers)
FROM_PEERS: list[type[betterproto.Message]] = [
    dp.AllocateRequest,
    dp.PreferredAllocationRequest,
    dp.PreStartContainerRequest,
    dp.Empty,
    dp.DevicePluginOptions,
    dra.NodePrepareResourcesRequest,
    dra.NodeUnprepareResourcesRequest,
    reg.InfoRequest,
    reg.RegistrationStatus,
    pr.ListPodResourcesResponse,
    pr.GetPodResourcesResponse,
]

SEEDS = [
    bytes(dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=["GPU-1", "GPU-2"])])),
    bytes(dra.NodePrepareResourcesRequest(claims=[dra.Claim(namespace="ns", uid="u-1", name="c")])),
]


def test_the_compiled_codec_is_in_use() -> None:
    assert betterproto.Message.__bytes__.__name__ == "__bytes_patch"


@pytest.mark.parametrize("cls", FROM_PEERS, ids=lambda c: c.__name__)
@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=64))
def test_any_bytes_parse_or_raise_an_ordinary_error(cls: type[betterproto.Message], data: bytes) -> None:
    with contextlib.suppress(Exception):  # a protocol error: grpclib turns it into a status
        cls().parse(data)


@settings(max_examples=500, deadline=None)
@given(seed=st.sampled_from(SEEDS), flips=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=4))
def test_damaged_real_requests_parse_or_raise_an_ordinary_error(seed: bytes, flips: list[tuple[int, int]]) -> None:
    data = bytearray(seed)
    for at, value in flips:
        data[at % len(data)] = value
    for cls in (dp.AllocateRequest, dra.NodePrepareResourcesRequest):
        with contextlib.suppress(Exception):
            cls().parse(bytes(data))


def test_a_truncated_field_is_an_error() -> None:
    """Stricter than betterproto's own codec, which silently cut the string short."""
    with pytest.raises(Exception, match="protobuf"):
        dp.AllocateRequest().parse(bytes.fromhex("0a0a0a08475055"))
