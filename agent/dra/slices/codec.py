"""ResourceSlices to and from the JSON of each ``resource.k8s.io`` version.

v1 and v1beta2 keep ``attributes``, ``capacity`` and ``taints`` on the device; v1beta1 nests
them under ``basic``. Capacity values are ``{"value": "<quantity>"}`` (with a ``requestPolicy``
on a device that ``allowMultipleAllocations``), attributes
``{"int"|"bool"|"string"|"version": value}``; a counter slice holds ``sharedCounters`` and a
device that takes from them ``consumesCounters`` (v1 and v1beta2 only: partitioning is never
written as v1beta1). Reading ignores what the server adds on its own (a taint's ``timeAdded``,
managed fields), so a stored slice compares equal to the one we sent unless the server changed
or dropped something we asked for — a disabled feature gate drops counters and shared devices
silently, which is how the publisher notices it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agent.dra.partitions import CounterSet, CounterUse
from agent.dra.slices.plan import (
    AttributeValue,
    CounterSlice,
    RequestPolicy,
    SliceDevice,
    StoredSlice,
    Taint,
)
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
    devices: Sequence[SliceDevice] | CounterSlice,
    name: str = "",
    generate_name: str = "",
    resource_version: str = "",
) -> dict[str, Any]:
    """A ResourceSlice for POST (``generate_name``) or PUT (``name`` + ``resource_version``);
    ``devices`` may be a counter slice's counter sets."""
    metadata: dict[str, Any] = {
        "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}]
    }
    if name:
        metadata["name"] = name
    else:
        metadata["generateName"] = generate_name
    if resource_version:
        metadata["resourceVersion"] = resource_version
    spec: dict[str, Any] = {
        "driver": driver,
        "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
        "nodeName": node,
    }
    if isinstance(devices, CounterSlice):
        spec["sharedCounters"] = [counter_set_json(s) for s in devices.sets]
    else:
        spec["devices"] = [device_json(d, version) for d in devices]
    return {"apiVersion": f"{GROUP}/{version}", "kind": KIND, "metadata": metadata, "spec": spec}


def _counters_json(counters: Sequence[tuple[str, str]]) -> dict[str, Any]:
    return {name: {"value": value} for name, value in counters}


def counter_set_json(counter_set: CounterSet) -> dict[str, Any]:
    return {"name": counter_set.name, "counters": _counters_json(counter_set.counters)}


def device_json(device: SliceDevice, version: str) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if device.attributes:
        fields["attributes"] = {key: {kind: value} for key, kind, value in device.attributes}
    if device.capacity:
        policies = dict(device.policies)
        fields["capacity"] = {key: _capacity_json(quantity, policies.get(key)) for key, quantity in device.capacity}
    if device.taints:
        fields["taints"] = [{"key": t.key, "value": t.value, "effect": t.effect} for t in device.taints]
    if device.consumes:
        fields["consumesCounters"] = [
            {"counterSet": c.counter_set, "counters": _counters_json(c.counters)} for c in device.consumes
        ]
    if device.allow_multiple:
        fields["allowMultipleAllocations"] = True
    if version == "v1beta1":
        return {"name": device.name, "basic": fields}
    return {"name": device.name, **fields}


def _capacity_json(quantity: str, policy: RequestPolicy | None) -> dict[str, Any]:
    if policy is None:
        return {"value": quantity}
    return {
        "value": quantity,
        "requestPolicy": {"default": policy.default, "validRange": {"min": policy.minimum, "step": policy.step}},
    }


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
    counters = spec.get("sharedCounters") or []
    if not isinstance(counters, list):
        raise ValueError("spec.sharedCounters is not a list")
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
        counters=tuple(_counter_set(c) for c in counters),
    )


def _counter_values(raw: Any) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(_dict(v).get("value", ""))) for k, v in _dict(raw).items()))


def _counter_set(raw: Any) -> CounterSet:
    raw = _dict(raw)
    return CounterSet(name=str(raw.get("name") or ""), counters=_counter_values(raw.get("counters")))


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
    raw_capacity = _dict(fields.get("capacity"))
    capacity = [(str(k), str(_dict(v).get("value", ""))) for k, v in raw_capacity.items()]
    policies = [(str(k), p) for k, v in raw_capacity.items() if (p := _policy(_dict(v).get("requestPolicy")))]
    taints = tuple(
        Taint(key=str(t.get("key", "")), value=str(t.get("value", "")), effect=str(t.get("effect", "")))
        for t in fields.get("taints") or []
        if isinstance(t, dict)
    )
    consumes = tuple(
        CounterUse(counter_set=str(c.get("counterSet") or ""), counters=_counter_values(c.get("counters")))
        for c in fields.get("consumesCounters") or []
        if isinstance(c, dict)
    )
    return SliceDevice(
        name=raw["name"],
        attributes=tuple(sorted(attributes)),
        capacity=tuple(sorted(capacity)),
        taints=taints,
        consumes=consumes,
        allow_multiple=fields.get("allowMultipleAllocations") is True,
        policies=tuple(sorted(policies, key=lambda p: p[0])),
    )


def _policy(raw: Any) -> RequestPolicy | None:
    if not isinstance(raw, dict):
        return None
    valid = _dict(raw.get("validRange"))
    return RequestPolicy(
        default=str(raw.get("default") or ""), minimum=str(valid.get("min") or ""), step=str(valid.get("step") or "")
    )


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else -1
