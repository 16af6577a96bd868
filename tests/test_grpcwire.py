"""The wire-shape check that runs before betterproto decodes a request."""

from __future__ import annotations

from dataclasses import dataclass

import betterproto
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent._proto.deviceplugin import v1beta1 as bpb
from agent.grpc.wireshape import ShapeLimits, WireShapeError, check_shape
from tests._grpcio import deviceplugin_v1beta1_pb2 as pb

LIMITS = ShapeLimits(max_fields=100, max_messages=10, max_depth=4)


def allocate(*containers: list[str]) -> bytes:
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=c) for c in containers])
    return request.SerializeToString()


def test_well_formed_requests_within_the_limits_pass_and_decode() -> None:
    data = allocate(["GPU-a", "GPU-b"], ["GPU-c"])
    check_shape(data, bpb.AllocateRequest, LIMITS)
    assert [c.devices_ids for c in bpb.AllocateRequest().parse(data).container_requests] == [
        ["GPU-a", "GPU-b"],
        ["GPU-c"],
    ]
    preferred = pb.PreferredAllocationRequest(
        container_requests=[pb.ContainerPreferredAllocationRequest(available_deviceIDs=["a", "b"], allocation_size=1)]
    ).SerializeToString()
    check_shape(preferred, bpb.PreferredAllocationRequest, LIMITS)
    check_shape(b"", bpb.Empty, LIMITS)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        # every nested message and every ID is a field: 10 containers of 9 IDs = 100 fields
        (allocate(*[["x"] * 9] * 10), None),
        (allocate(*[["x"] * 9] * 10, []), "more than 10 nested messages in one request"),
        (allocate(["x"] * 100), "more than 100 fields in one request"),
        (allocate(*[[]] * 11), "more than 10 nested messages in one request"),
    ],
)
def test_limits_are_exact(data: bytes, message: str | None) -> None:
    if message is None:
        check_shape(data, bpb.AllocateRequest, LIMITS)
    else:
        with pytest.raises(WireShapeError, match=message):
            check_shape(data, bpb.AllocateRequest, LIMITS)


def test_packed_numbers_count_every_byte() -> None:
    # allocation_size is not repeated, but a peer may still send it length-delimited (packed)
    data = b"\x0a\x06" + b"\x18\x64" + b"\x0a\x00\x0a\x00"  # container request: size 100, two IDs
    check_shape(data, bpb.PreferredAllocationRequest, LIMITS)
    packed = b"\x0a\x7e" + b"\x1a\x7c" + b"\x01" * 124  # 124 packed elements in one field
    with pytest.raises(WireShapeError, match="more than 100 fields"):
        check_shape(packed, bpb.PreferredAllocationRequest, LIMITS)


@dataclass(eq=False, repr=False)
class Node(betterproto.Message):
    child: Node = betterproto.message_field(1)  # noqa: RUF009 - how betterproto declares fields


def nested(depth: int) -> bytes:
    data = b""
    for _ in range(depth):
        data = b"\x0a" + bytes([len(data)]) + data
    return data


def test_nesting_depth_is_bounded() -> None:
    check_shape(nested(4), Node, LIMITS)
    assert Node().parse(nested(4)).child.child.child.child == Node()
    with pytest.raises(WireShapeError, match="nested deeper than 4 levels"):
        check_shape(nested(5), Node, LIMITS)


def test_unknown_fields_are_skipped_whole() -> None:
    # unknown field numbers are skipped whole, never descended into
    data = b"\x7a\x02\x7a\x00" * 3
    check_shape(data, bpb.AllocateRequest, LIMITS)


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"\x0a", "truncated varint"),
        (b"\x0a\x05ab", "a length runs past the end"),
        (b"\x08" + b"\xff" * 11, "varint longer than 10 bytes"),
        (b"\x00\x00", "field number 0"),
        (b"\x0b", "wire type 3"),
        (b"\x0f", "wire type 7"),
        (b"\x09\x00\x00", "a field runs past the end"),
        (b"\x0a\x03\x0a\x05a", "a length runs past the end"),  # inside a nested message
    ],
)
def test_malformed_bytes_are_one_line_errors(data: bytes, problem: str) -> None:
    with pytest.raises(WireShapeError) as err:
        check_shape(data, bpb.AllocateRequest, LIMITS)
    assert problem in str(err.value) and "\n" not in str(err.value)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_either_pass_or_raise_wire_shape_error(data: bytes) -> None:
    try:
        check_shape(data, bpb.AllocateRequest, LIMITS)
    except WireShapeError:
        return


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.text(max_size=8), max_size=6), max_size=6))
def test_real_requests_pass_whenever_they_are_within_the_limits(containers: list[list[str]]) -> None:
    data = allocate(*containers)
    fields = len(containers) + sum(len(c) for c in containers)
    if fields <= LIMITS.max_fields and len(containers) <= LIMITS.max_messages:
        check_shape(data, bpb.AllocateRequest, LIMITS)
