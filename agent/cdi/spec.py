"""A typed model of the CDI spec document, its validation and its minimum version.

Parsing is strict like the Go library's: an unknown field anywhere rejects the document.
:func:`validate` returns every problem at once (``gpu-agent cdi check`` prints them all);
:func:`minimum_version` picks the lowest ``cdiVersion`` that the used fields need, and the
agent always writes exactly that (older runtimes reject versions they do not know).
"""

from __future__ import annotations

import functools
import json
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from agent.cdi.errors import InvalidSpecError
from agent.cdi.names import class_problem, device_name_problem, vendor_problem

KNOWN_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
BASELINE_VERSION = "0.3.0"
HOOK_NAMES = frozenset({"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"})
DEVICE_TYPES = frozenset({"", "b", "c", "u", "p"})


@dataclass(frozen=True, slots=True)
class DeviceNode:
    path: str  # in the container
    host_path: str | None = None  # cdiVersion 0.5.0
    type: str | None = None
    major: int | None = None
    minor: int | None = None
    file_mode: int | None = None
    permissions: str | None = None
    uid: int | None = None
    gid: int | None = None


@dataclass(frozen=True, slots=True)
class Mount:
    host_path: str
    container_path: str
    options: tuple[str, ...] = ()
    type: str | None = None  # cdiVersion 0.4.0


@dataclass(frozen=True, slots=True)
class Hook:
    hook_name: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None


@dataclass(frozen=True, slots=True)
class IntelRdt:  # cdiVersion 0.7.0; schemata/enableMonitoring 1.1.0
    clos_id: str | None = None
    l3_cache_schema: str | None = None
    mem_bw_schema: str | None = None
    schemata: tuple[str, ...] = ()
    enable_monitoring: bool | None = None
    enable_cmt: bool | None = None  # 0.7.0 .. 1.0.x only
    enable_mbm: bool | None = None


@dataclass(frozen=True, slots=True)
class NetDevice:  # cdiVersion 1.1.0
    host_interface_name: str
    name: str


@dataclass(frozen=True, slots=True)
class ContainerEdits:
    env: tuple[str, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()
    intel_rdt: IntelRdt | None = None
    additional_gids: tuple[int, ...] = ()
    net_devices: tuple[NetDevice, ...] = ()

    def is_empty(self) -> bool:
        return not (
            self.env
            or self.device_nodes
            or self.mounts
            or self.hooks
            or self.intel_rdt is not None
            or self.additional_gids
            or self.net_devices
        )


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    container_edits: ContainerEdits
    annotations: Mapping[str, str] = field(default_factory=dict)  # cdiVersion 0.6.0


@dataclass(frozen=True, slots=True)
class Spec:
    version: str
    kind: str
    devices: tuple[Device, ...]
    container_edits: ContainerEdits = ContainerEdits()
    annotations: Mapping[str, str] = field(default_factory=dict)  # cdiVersion 0.6.0

    @classmethod
    def at_minimum_version(
        cls, *, kind: str, devices: tuple[Device, ...], container_edits: ContainerEdits = ContainerEdits()
    ) -> Spec:
        """A spec that declares the lowest cdiVersion its fields need."""
        spec = cls(version=BASELINE_VERSION, kind=kind, devices=devices, container_edits=container_edits)
        return replace(spec, version=minimum_version(spec))

    @property
    def device_names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.devices)

    def qualified_names(self) -> tuple[str, ...]:
        return tuple(f"{self.kind}={d.name}" for d in self.devices)


# --- versions ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)  # a handful of versions, parsed on every spec validated
def version_key(version: str) -> tuple[int, ...]:
    """``"v0.5.0"`` / ``"0.5.0"`` -> (0, 5, 0); ValueError when not a version."""
    text = version[1:] if version.startswith("v") else version
    parts = text.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a semantic version: {version!r}")
    return tuple(int(p) for p in parts)


def _all_edits(spec: Spec) -> Iterator[ContainerEdits]:
    yield spec.container_edits
    for device in spec.devices:
        yield device.container_edits


def minimum_version(spec: Spec) -> str:
    """The lowest cdiVersion that every field ``spec`` uses is defined in."""
    edits = list(_all_edits(spec))
    if any(e.net_devices for e in edits) or any(
        e.intel_rdt is not None and (e.intel_rdt.schemata or e.intel_rdt.enable_monitoring is not None) for e in edits
    ):
        return "1.1.0"
    if any(e.intel_rdt is not None or e.additional_gids for e in edits):
        return "0.7.0"
    _, _, klass = spec.kind.partition("/")
    if spec.annotations or any(d.annotations for d in spec.devices) or "." in klass:
        return "0.6.0"
    if any(n.host_path for e in edits for n in e.device_nodes) or any(d.name[:1].isdigit() for d in spec.devices):
        return "0.5.0"
    if any(m.type for e in edits for m in e.mounts):
        return "0.4.0"
    return BASELINE_VERSION


# --- validation ----------------------------------------------------------------------------


def _env_problem(entry: str, where: str) -> str | None:
    if "=" not in entry or entry.startswith("="):
        return f"{where}: invalid environment variable {entry!r} (want NAME=VALUE)"
    return None


def _edits_problems(edits: ContainerEdits, where: str) -> Iterator[str]:
    for i, entry in enumerate(edits.env):
        if problem := _env_problem(entry, f"{where}.env[{i}]"):
            yield problem
    for i, node in enumerate(edits.device_nodes):
        at = f"{where}.deviceNodes[{i}]"
        if not node.path.startswith("/"):
            yield f"{at}.path: must be an absolute path, got {node.path!r}"
        if node.host_path is not None and node.host_path and not node.host_path.startswith("/"):
            yield f"{at}.hostPath: must be an absolute path, got {node.host_path!r}"
        if node.type is not None and node.type not in DEVICE_TYPES:
            yield f"{at}.type: must be one of b, c, u, p, got {node.type!r}"
        if node.permissions and set(node.permissions) - set("rwm"):
            yield f"{at}.permissions: only r, w and m allowed, got {node.permissions!r}"
    for i, mount in enumerate(edits.mounts):
        at = f"{where}.mounts[{i}]"
        if not mount.host_path:
            yield f"{at}.hostPath: must not be empty"
        elif mount.type in (None, "", "bind", "rbind") and not mount.host_path.startswith("/"):
            yield f"{at}.hostPath: a bind mount needs an absolute path, got {mount.host_path!r}"
        if not mount.container_path.startswith("/"):
            yield f"{at}.containerPath: must be an absolute path, got {mount.container_path!r}"
    for i, hook in enumerate(edits.hooks):
        at = f"{where}.hooks[{i}]"
        if hook.hook_name not in HOOK_NAMES:
            yield f"{at}.hookName: unknown hook {hook.hook_name!r} (want one of {', '.join(sorted(HOOK_NAMES))})"
        if not hook.path.startswith("/"):
            yield f"{at}.path: must be an absolute path, got {hook.path!r}"
        for j, entry in enumerate(hook.env):
            if problem := _env_problem(entry, f"{at}.env[{j}]"):
                yield problem
        if hook.timeout is not None and hook.timeout <= 0:
            yield f"{at}.timeout: must be greater than 0, got {hook.timeout}"
    if edits.intel_rdt is not None:
        clos = edits.intel_rdt.clos_id
        if clos and clos != "/" and (clos in (".", "..") or "/" in clos or "\n" in clos or len(clos) >= 4096):
            yield f"{where}.intelRdt.closID: invalid {clos!r}"
    hosts = [n.host_interface_name for n in edits.net_devices]
    names = [n.name for n in edits.net_devices]
    if any(not h for h in hosts) or any(not n for n in names):
        yield f"{where}.netDevices: names must not be empty"
    if len(set(hosts)) != len(hosts) or len(set(names)) != len(names):
        yield f"{where}.netDevices: duplicate interface names"


_KNOWN_KEYS = frozenset(version_key(v) for v in KNOWN_VERSIONS)


def validate(spec: Spec) -> list[str]:
    """Every rule the Go library enforces (and absolute paths), as one message per problem."""
    problems: list[str] = []
    try:
        declared = version_key(spec.version)
    except ValueError:
        declared = None
    if declared is None or declared not in _KNOWN_KEYS:
        problems.append(f"cdiVersion: unknown version {spec.version!r} (known: {', '.join(KNOWN_VERSIONS)})")
    else:
        needed = minimum_version(spec)
        if declared < version_key(needed):
            problems.append(f"cdiVersion: the spec version must be at least v{needed} for the fields used")
    vendor, sep, klass = spec.kind.partition("/")
    if not sep:
        problems.append(f"kind: {spec.kind!r} is not <vendor>/<class>")
    elif problem := (vendor_problem(vendor) or class_problem(klass)):
        problems.append(f"kind: {problem}")
    if not spec.devices:
        problems.append("devices: a spec needs at least one device")
    seen: set[str] = set()
    for i, device in enumerate(spec.devices):
        where = f"devices[{i}]"
        if problem := device_name_problem(device.name):
            problems.append(f"{where}.name: {problem}")
        if device.name in seen:
            problems.append(f"{where}.name: duplicate device name {device.name!r}")
        seen.add(device.name)
        if device.container_edits.is_empty():
            problems.append(f"{where} ({device.name}): invalid device, empty device edits")
        problems.extend(_edits_problems(device.container_edits, f"{where}.containerEdits"))
    problems.extend(_edits_problems(spec.container_edits, "containerEdits"))
    return problems


def check(spec: Spec) -> Spec:
    """``spec`` if it validates, else InvalidSpecError listing every problem."""
    problems = validate(spec)
    if problems:
        raise InvalidSpecError(f"invalid CDI spec {spec.kind!r}: {'; '.join(problems)}", tuple(problems))
    return spec


# --- serialisation -------------------------------------------------------------------------


def _node_dict(node: DeviceNode) -> dict[str, Any]:
    out: dict[str, Any] = {"path": node.path}
    for key, value in (
        ("hostPath", node.host_path),
        ("type", node.type),
        ("major", node.major),
        ("minor", node.minor),
        ("fileMode", node.file_mode),
        ("permissions", node.permissions),
        ("uid", node.uid),
        ("gid", node.gid),
    ):
        if value is not None and value != "":
            out[key] = value
    return out


def _mount_dict(mount: Mount) -> dict[str, Any]:
    out: dict[str, Any] = {"hostPath": mount.host_path, "containerPath": mount.container_path}
    if mount.options:
        out["options"] = list(mount.options)
    if mount.type:
        out["type"] = mount.type
    return out


def _hook_dict(hook: Hook) -> dict[str, Any]:
    out: dict[str, Any] = {"hookName": hook.hook_name, "path": hook.path}
    if hook.args:
        out["args"] = list(hook.args)
    if hook.env:
        out["env"] = list(hook.env)
    if hook.timeout is not None:
        out["timeout"] = hook.timeout
    return out


def _rdt_dict(rdt: IntelRdt) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (
        ("closID", rdt.clos_id),
        ("l3CacheSchema", rdt.l3_cache_schema),
        ("memBwSchema", rdt.mem_bw_schema),
        ("schemata", list(rdt.schemata) or None),
        ("enableMonitoring", rdt.enable_monitoring),
        ("enableCMT", rdt.enable_cmt),
        ("enableMBM", rdt.enable_mbm),
    ):
        if value is not None:
            out[key] = value
    return out


def edits_dict(edits: ContainerEdits) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if edits.env:
        out["env"] = list(edits.env)
    if edits.device_nodes:
        out["deviceNodes"] = [_node_dict(n) for n in edits.device_nodes]
    if edits.mounts:
        out["mounts"] = [_mount_dict(m) for m in edits.mounts]
    if edits.hooks:
        out["hooks"] = [_hook_dict(h) for h in edits.hooks]
    if edits.intel_rdt is not None:
        out["intelRdt"] = _rdt_dict(edits.intel_rdt)
    if edits.additional_gids:
        out["additionalGids"] = list(edits.additional_gids)
    if edits.net_devices:
        out["netDevices"] = [{"hostInterfaceName": n.host_interface_name, "name": n.name} for n in edits.net_devices]
    return out


def to_dict(spec: Spec) -> dict[str, Any]:
    out: dict[str, Any] = {"cdiVersion": spec.version, "kind": spec.kind}
    if spec.annotations:
        out["annotations"] = dict(spec.annotations)
    devices: list[dict[str, Any]] = []
    for device in spec.devices:
        entry: dict[str, Any] = {"name": device.name}
        if device.annotations:
            entry["annotations"] = dict(device.annotations)
        entry["containerEdits"] = edits_dict(device.container_edits)
        devices.append(entry)
    out["devices"] = devices
    if not spec.container_edits.is_empty():
        out["containerEdits"] = edits_dict(spec.container_edits)
    return out


def dumps(spec: Spec, *, compact: bool = False) -> str:
    """The canonical JSON text the agent writes (stable, so drift is a byte comparison).

    ``compact``: one line, no spaces. The standard library encodes that in C and indented JSON
    in Python: a spec with the driver's libraries mounted takes about 40 µs instead of 280 µs,
    which claim specs, written on every NodePrepareResources, pay per claim.
    """
    if compact:
        return json.dumps(to_dict(spec), separators=(",", ":")) + "\n"
    return json.dumps(to_dict(spec), indent=2) + "\n"


# --- parsing ---------------------------------------------------------------------------------

T = TypeVar("T")


class _Fields:
    """Strict access to one JSON object: unknown keys and wrong types are errors."""

    def __init__(self, value: Any, where: str, allowed: tuple[str, ...]) -> None:
        if not isinstance(value, dict):
            raise InvalidSpecError(f"{where}: expected an object, got {type(value).__name__}")
        unknown = sorted(str(k) for k in value if k not in allowed)
        if unknown:
            raise InvalidSpecError(f"{where}: unknown field {unknown[0]!r}")
        self._value = value
        self._where = where

    def at(self, key: str) -> str:
        return f"{self._where}.{key}" if self._where else key

    def get(self, key: str, kind: type[T], *, required: bool = False) -> T | None:
        value = self._value.get(key)
        if value is None:
            if required:
                raise InvalidSpecError(f"{self.at(key)}: required field missing")
            return None
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if not ok:
            raise InvalidSpecError(f"{self.at(key)}: expected {kind.__name__}, got {type(value).__name__}")
        return typing.cast(T, value)

    def text(self, key: str, *, required: bool = False) -> str | None:
        return self.get(key, str, required=required)

    def integer(self, key: str) -> int | None:
        return self.get(key, int)

    def items(self, key: str, parse: Callable[[Any, str], T]) -> tuple[T, ...]:
        values = self.get(key, list) or []
        return tuple(parse(v, f"{self.at(key)}[{i}]") for i, v in enumerate(values))

    def strings(self, key: str) -> tuple[str, ...]:
        return self.items(key, _string)

    def mapping(self, key: str) -> dict[str, str]:
        value = self.get(key, dict) or {}
        for k, v in value.items():
            if not isinstance(v, str):
                raise InvalidSpecError(f"{self.at(key)}.{k}: expected str, got {type(v).__name__}")
        return dict(value)


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidSpecError(f"{where}: expected str, got {type(value).__name__}")
    return value


def _gid(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidSpecError(f"{where}: expected a non-negative integer, got {value!r}")
    return value


def _parse_node(value: Any, where: str) -> DeviceNode:
    f = _Fields(value, where, ("path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"))
    return DeviceNode(
        path=f.text("path", required=True) or "",
        host_path=f.text("hostPath") or None,
        type=f.text("type") or None,
        major=f.integer("major"),
        minor=f.integer("minor"),
        file_mode=f.integer("fileMode"),
        permissions=f.text("permissions") or None,
        uid=f.integer("uid"),
        gid=f.integer("gid"),
    )


def _parse_mount(value: Any, where: str) -> Mount:
    f = _Fields(value, where, ("hostPath", "containerPath", "options", "type"))
    return Mount(
        host_path=f.text("hostPath", required=True) or "",
        container_path=f.text("containerPath", required=True) or "",
        options=f.strings("options"),
        type=f.text("type") or None,
    )


def _parse_hook(value: Any, where: str) -> Hook:
    f = _Fields(value, where, ("hookName", "path", "args", "env", "timeout"))
    return Hook(
        hook_name=f.text("hookName", required=True) or "",
        path=f.text("path", required=True) or "",
        args=f.strings("args"),
        env=f.strings("env"),
        timeout=f.integer("timeout"),
    )


def _parse_rdt(value: Any, where: str) -> IntelRdt:
    keys = ("closID", "l3CacheSchema", "memBwSchema", "schemata", "enableMonitoring", "enableCMT", "enableMBM")
    f = _Fields(value, where, keys)
    return IntelRdt(
        clos_id=f.text("closID"),
        l3_cache_schema=f.text("l3CacheSchema"),
        mem_bw_schema=f.text("memBwSchema"),
        schemata=f.strings("schemata"),
        enable_monitoring=f.get("enableMonitoring", bool),
        enable_cmt=f.get("enableCMT", bool),
        enable_mbm=f.get("enableMBM", bool),
    )


def _parse_net(value: Any, where: str) -> NetDevice:
    f = _Fields(value, where, ("hostInterfaceName", "name"))
    return NetDevice(host_interface_name=f.text("hostInterfaceName") or "", name=f.text("name") or "")


def _parse_edits(value: Any, where: str) -> ContainerEdits:
    keys = ("env", "deviceNodes", "mounts", "hooks", "intelRdt", "additionalGids", "netDevices")
    f = _Fields(value, where, keys)
    rdt = f.get("intelRdt", dict)
    return ContainerEdits(
        env=f.strings("env"),
        device_nodes=f.items("deviceNodes", _parse_node),
        mounts=f.items("mounts", _parse_mount),
        hooks=f.items("hooks", _parse_hook),
        intel_rdt=_parse_rdt(rdt, f.at("intelRdt")) if rdt is not None else None,
        additional_gids=tuple(g for g in f.items("additionalGids", _gid) if g != 0),
        net_devices=f.items("netDevices", _parse_net),
    )


def _parse_device(value: Any, where: str) -> Device:
    f = _Fields(value, where, ("name", "annotations", "containerEdits"))
    edits = f.get("containerEdits", dict)
    return Device(
        name=f.text("name", required=True) or "",
        annotations=f.mapping("annotations"),
        container_edits=_parse_edits(edits, f.at("containerEdits")) if edits is not None else ContainerEdits(),
    )


def from_dict(document: Any) -> Spec:
    """A spec from a decoded JSON/YAML document; InvalidSpecError on any structural fault."""
    if document is None:
        raise InvalidSpecError("empty spec document")
    f = _Fields(document, "", ("cdiVersion", "kind", "annotations", "devices", "containerEdits"))
    edits = f.get("containerEdits", dict)
    return Spec(
        version=f.text("cdiVersion", required=True) or "",
        kind=f.text("kind", required=True) or "",
        annotations=f.mapping("annotations"),
        devices=f.items("devices", _parse_device),
        container_edits=_parse_edits(edits, "containerEdits") if edits is not None else ContainerEdits(),
    )


def loads(text: str, *, yaml_format: bool = False) -> Spec:
    """Parse (not validate) a spec file's text."""
    if yaml_format:
        import yaml

        try:
            document = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise InvalidSpecError(f"not valid YAML: {str(exc).splitlines()[0]}") from exc
    else:
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidSpecError(f"not valid JSON: {exc}") from exc
    return from_dict(document)
