"""ResourceSlices to and from the JSON of each ``resource.k8s.io`` version.

v1 and v1beta2 keep ``attributes``, ``capacity`` and ``taints`` on the device; v1beta1 nests
them under ``basic``. Capacity values are ``{"value": "<quantity>"}``, attributes
``{"int"|"bool"|"string"|"version": value}``. Reading ignores what the server adds on its own
(a taint's ``timeAdded``, managed fields), so a stored slice compares equal to the one we sent
unless the server changed or dropped something we asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agent.dra.slices.plan import AttributeValue, SliceDevice, StoredSlice, Taint
from agent.kube.discovery import GROUP

KIND = "ResourceSlice"
_ATTRIBUTE_KINDS = ("int", "bool", "string", "version")


def slice_body(
    version: str,
    *,
    node: str,
    node_uid: str,
    driver: str,
    generation: int,
    count: int,
    devices: Sequence[SliceDevice],
    name: str = "",
    generate_name: str = "",
    resource_version: str = "",
) -> dict[str, Any]:
    """A ResourceSlice for POST (``generate_name``) or PUT (``name`` + ``resource_version``)."""
    metadata: dict[str, Any] = {
        "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}]
    }
    if name:
        metadata["name"] = name
    else:
        metadata["generateName"] = generate_name
    if resource_version:
        metadata["resourceVersion"] = resource_version
    return {
        "apiVersion": f"{GROUP}/{version}",
        "kind": KIND,
        "metadata": metadata,
        "spec": {
            "driver": driver,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
            "nodeName": node,
            "devices": [device_json(d, version) for d in devices],
        },
    }


def device_json(device: SliceDevice, version: str) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if device.attributes:
        fields["attributes"] = {key: {kind: value} for key, kind, value in device.attributes}
    if device.capacity:
        fields["capacity"] = {key: {"value": quantity} for key, quantity in device.capacity}
    if device.taints:
        fields["taints"] = [{"key": t.key, "value": t.value, "effect": t.effect} for t in device.taints]
    if version == "v1beta1":
        return {"name": device.name, "basic": fields}
    return {"name": device.name, **fields}


def parse_slice(obj: Any, version: str) -> StoredSlice:
    """A listed or watched ResourceSlice; raises ValueError when its shape is not a slice's."""
    if not isinstance(obj, dict):
        raise ValueError("not an object")
    metadata, spec = _dict(obj.get("metadata")), _dict(obj.get("spec"))
    pool = _dict(spec.get("pool"))
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("no metadata.name")
    devices = spec.get("devices") or []
    if not isinstance(devices, list):
        raise ValueError("spec.devices is not a list")
    owner_uid = ""
    for ref in metadata.get("ownerReferences") or []:
        if isinstance(ref, dict) and ref.get("kind") == "Node" and ref.get("controller") is True:
            owner_uid = str(ref.get("uid") or "")
    return StoredSlice(
        name=name,
        uid=str(metadata.get("uid") or ""),
        resource_version=str(metadata.get("resourceVersion") or ""),
        driver=str(spec.get("driver") or ""),
        pool=str(pool.get("name") or ""),
        generation=_int(pool.get("generation")),
        count=_int(pool.get("resourceSliceCount")),
        node_name=str(spec.get("nodeName") or ""),
        devices=tuple(_device(d, version) for d in devices),
        owner_uid=owner_uid,
    )


def _device(raw: Any, version: str) -> SliceDevice:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise ValueError("a device without a name")
    fields = _dict(raw.get("basic")) if version == "v1beta1" else raw
    attributes: list[tuple[str, str, AttributeValue]] = []
    for key, value in _dict(fields.get("attributes")).items():
        value = _dict(value)
        kind = next((k for k in _ATTRIBUTE_KINDS if k in value), "")
        found = value.get(kind) if kind else None
        attributes.append((str(key), kind, found if isinstance(found, int | bool | str) else ""))
    capacity = [(str(k), str(_dict(v).get("value", ""))) for k, v in _dict(fields.get("capacity")).items()]
    taints = tuple(
        Taint(key=str(t.get("key", "")), value=str(t.get("value", "")), effect=str(t.get("effect", "")))
        for t in fields.get("taints") or []
        if isinstance(t, dict)
    )
    return SliceDevice(
        name=raw["name"], attributes=tuple(sorted(attributes)), capacity=tuple(sorted(capacity)), taints=taints
    )


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else -1
