"""A ResourceClaim's JSON (v1, v1beta2 or v1beta1) as the version-neutral :class:`ResourceClaim`.

The parts preparation reads have the same shape in all three versions: ``status.allocation``
(``devices.results[]``, ``devices.config[]``, ``allocationTimestamp``) and ``status.reservedFor``.
Only the spec differs (v1beta1 puts ``adminAccess`` on the request, v1/v1beta2 under
``exactly``); it is read only for ``adminAccess`` when a result does not carry it (1.31-era
servers). Anything that is not the shape the API promises — for instance opaque
``parameters`` that are not a JSON object — is a :class:`ClaimFormatError` naming the field,
which preparation reports for that claim alone.
"""

from __future__ import annotations

from typing import Any

from agent.kube.claims.model import DeviceResult, OpaqueConfig, PodRef, ResourceClaim
from agent.kube.errors import KubeError

#: far above the API's own limits (32 results, 64 configs, 256 reservations)
MAX_RESULTS = 256
MAX_CONFIGS = 256
MAX_RESERVED = 1024
#: capacities of one device (the API allows 32 attributes and capacities together), and their text
MAX_CAPACITIES = 64
MAX_CAPACITY_TEXT = 128


class ClaimFormatError(KubeError):
    """The API server's claim is not shaped as the API promises (retrying will not help)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, recoverable=False)


def parse_claim(obj: Any, *, api_version: str) -> ResourceClaim:
    """Raises ClaimFormatError naming the first field that is not as the API defines it."""
    if not isinstance(obj, dict):
        raise ClaimFormatError("ResourceClaim: not a JSON object")
    metadata = _dict(obj.get("metadata"))
    namespace, name, uid = (str(metadata.get(k) or "") for k in ("namespace", "name", "uid"))
    where = f"ResourceClaim {namespace}/{name}"
    status = _dict(obj.get("status"))
    allocation = status.get("allocation")
    raw_reserved = _list(status, "reservedFor", f"{where}: status")
    if len(raw_reserved) > MAX_RESERVED:
        raise ClaimFormatError(f"{where}: status.reservedFor has {len(raw_reserved)} entries")
    reserved = tuple(_pod(r, f"{where}: status.reservedFor[{i}]") for i, r in enumerate(raw_reserved))
    if not isinstance(allocation, dict):
        return ResourceClaim(
            namespace=namespace, name=name, uid=uid, allocated=False, reserved_for=reserved, api_version=api_version
        )
    devices = _dict(allocation.get("devices"))
    at = f"{where}: status.allocation.devices"
    raw_results, raw_configs = _list(devices, "results", at), _list(devices, "config", at)
    if len(raw_results) > MAX_RESULTS or len(raw_configs) > MAX_CONFIGS:
        raise ClaimFormatError(f"{where}: {len(raw_results)} results and {len(raw_configs)} configs; too many")
    admin = _admin_requests(_dict(obj.get("spec")))
    results = tuple(
        _result(r, f"{where}: status.allocation.devices.results[{i}]", admin) for i, r in enumerate(raw_results)
    )
    configs = tuple(_config(c, f"{where}: status.allocation.devices.config[{i}]") for i, c in enumerate(raw_configs))
    timestamp = allocation.get("allocationTimestamp")
    return ResourceClaim(
        namespace=namespace,
        name=name,
        uid=uid,
        allocated=True,
        results=results,
        configs=configs,
        reserved_for=reserved,
        allocation_timestamp=timestamp if isinstance(timestamp, str) else None,
        api_version=api_version,
    )


def _result(raw: Any, where: str, admin: set[str]) -> DeviceResult:
    if not isinstance(raw, dict):
        raise ClaimFormatError(f"{where}: not an object")
    fields = {k: _string(raw, k, where) for k in ("request", "driver", "pool", "device")}
    share_id = raw.get("shareID")
    if share_id is not None and not isinstance(share_id, str):
        raise ClaimFormatError(f"{where}.shareID: not a string")
    admin_access = raw.get("adminAccess")
    if admin_access is None:
        admin_access = fields["request"].partition("/")[0] in admin
    elif not isinstance(admin_access, bool):
        raise ClaimFormatError(f"{where}.adminAccess: not a boolean")
    consumed = raw.get("consumedCapacity") or {}
    if not isinstance(consumed, dict) or len(consumed) > MAX_CAPACITIES:
        raise ClaimFormatError(f"{where}.consumedCapacity: not a map of at most {MAX_CAPACITIES} quantities")
    for name, value in consumed.items():
        if not isinstance(value, str) or len(name) > MAX_CAPACITY_TEXT or len(value) > MAX_CAPACITY_TEXT:
            raise ClaimFormatError(f"{where}.consumedCapacity: {name[:40]!r} is not a quantity")
    return DeviceResult(**fields, share_id=share_id or None, admin_access=admin_access, consumed=consumed)


def _config(raw: Any, where: str) -> OpaqueConfig:
    if not isinstance(raw, dict):
        raise ClaimFormatError(f"{where}: not an object")
    requests = raw.get("requests") or []
    if not isinstance(requests, list) or not all(isinstance(r, str) for r in requests):
        raise ClaimFormatError(f"{where}.requests: not a list of strings")
    opaque = raw.get("opaque")
    if not isinstance(opaque, dict):
        raise ClaimFormatError(f"{where}: no opaque configuration (the only kind there is)")
    parameters = opaque.get("parameters")
    if not isinstance(parameters, dict):
        kind = "null" if parameters is None else type(parameters).__name__
        raise ClaimFormatError(f"{where}.opaque.parameters: must be a JSON object, got {kind}")
    return OpaqueConfig(
        source=str(raw.get("source") or ""),
        driver=_string(opaque, "driver", f"{where}.opaque"),
        requests=tuple(requests),
        parameters=parameters,
    )


def _pod(raw: Any, where: str) -> PodRef:
    if not isinstance(raw, dict):
        raise ClaimFormatError(f"{where}: not an object")
    return PodRef(
        name=_string(raw, "name", where), uid=str(raw.get("uid") or ""), resource=str(raw.get("resource") or "pods")
    )


def _admin_requests(spec: dict[str, Any]) -> set[str]:
    """Requests that ask for admin access in the spec (v1beta1 flat, v1/v1beta2 ``exactly``)."""
    out: set[str] = set()
    for request in _list(_dict(spec.get("devices")), "requests"):
        if not isinstance(request, dict):
            continue
        flat = request.get("adminAccess")
        exactly = _dict(request.get("exactly")).get("adminAccess")
        if flat is True or exactly is True:
            out.add(str(request.get("name") or ""))
    return out


def _string(raw: dict[str, Any], key: str, where: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value:
        raise ClaimFormatError(f"{where}.{key}: not a non-empty string")
    return value


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(raw: dict[str, Any], key: str, where: str = "") -> list[Any]:
    value = raw.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ClaimFormatError(f"{where}{'.' if where else ''}{key}: not a list")
    return value
