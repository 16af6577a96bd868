"""Turn a YAML document plus overrides (env, flags) into a validated :class:`Config`.

Validation is driven by the dataclass type hints in ``schema.py``: unknown keys, wrong
types and bad values are reported as one :class:`ConfigError` line naming the dotted
field path and the offending value. Dict fields merge the user's entries over their
defaults (so adding ``xids: {79: fatal}`` keeps the default application-Xid rules).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import math
import os
import re
import threading
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from agent.base.errors import ConfigError
from agent.core.config.reader import read_file_bounded
from agent.core.config.schema import Config, XidRule

ENV_PREFIX = "GPU_AGENT_"

#: ``GPU_AGENT_<NAME>`` variables and the config field each one sets.
ENV_FIELDS: dict[str, str] = {
    "BACKEND": "backend",
    "PRESET": "preset",
    "NODE_NAME": "node_name",
    "DEBUG_ADDR": "debug_addr",
    "KUBECONFIG": "kubeconfig",
    "LOG_LEVEL": "log_level",
    "KUBELET_ROOT": "paths.kubelet_root",
    "DEVICE_PLUGINS_DIR": "paths.device_plugins_dir",
    "CDI_ROOT": "paths.cdi_root",
    "STATE_DIR": "paths.state_dir",
    "DRIVER_ROOT": "paths.driver_root",
    "HOST_DRIVER_ROOT": "paths.host_driver_root",
    "CDI_HOOK_PATH": "cdi.hook_path",
}


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    config: Config
    version: str  # short digest of the effective config
    source: str  # the file it came from, or "defaults"
    #: digest of the exact bytes parsed (the watcher's baseline: a change after them is news)
    file_digest: str = ""


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Overrides from ``GPU_AGENT_*`` variables (empty values are ignored)."""
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for name, dotted in ENV_FIELDS.items():
        value = environ.get(ENV_PREFIX + name, "")
        if value:
            out[dotted] = value
    return out


def read_config_bytes(path: Path) -> bytes:
    """The config file's bytes: a regular file of at most 1 MiB (a ConfigMap's limit), read without blocking."""
    return read_file_bounded(path, label=f"config file {path}")


def parse_config_bytes(data: bytes, label: str) -> dict[str, Any]:
    """UTF-8 YAML holding a mapping; anything else is a one-line ConfigError."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{label} is not UTF-8 text (bad byte at offset {exc.start})") from exc
    return parse_yaml_mapping(text, label)


def bytes_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_document(path: Path) -> dict[str, Any]:
    """Parse a config file; an unreadable or non-mapping file is a ConfigError."""
    return parse_config_bytes(read_config_bytes(path), f"config file {path}")


#: libyaml's safe loader parses about four times faster than the pure-Python one
_SafeLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = True


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a YAML document is built.

    A 1 MiB document makes about a million objects. The collector would walk every object of
    the process several times meanwhile, in whichever thread allocates and holding the GIL, so
    parsing in a worker thread still paused the event loop for 0.1-0.3 s at a time (measured).
    Building a document leaves no cycles to collect; collection resumes when the last parse ends.
    """
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


def parse_yaml_mapping(text: str, label: str) -> dict[str, Any]:
    """YAML text that must hold a mapping (empty text is an empty one); one-line ConfigError otherwise."""
    try:
        with _gc_paused():
            doc = yaml.load(text, Loader=_SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{label} is not valid YAML{where}: {problem}") from exc
    except (ValueError, RecursionError, OverflowError) as exc:  # e.g. an integer of 5000 digits
        raise ConfigError(f"{label} is not usable YAML: {type(exc).__name__}: {str(exc)[:80]}") from exc
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{label}: expected a mapping at the top level, got {type(doc).__name__}")
    return doc


def build_config(document: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> Config:
    """Validate ``document`` with dotted-path ``overrides`` applied on top."""
    _check_shape(document)
    merged: dict[str, Any] = _deep_copy(dict(document))
    for dotted, value in (overrides or {}).items():
        _set_dotted(merged, dotted, value)
    config = convert(Config, merged, "")
    check_semantics(config)
    return typing.cast(Config, config)


def load_config(path: Path | None, overrides: Mapping[str, Any] | None = None) -> LoadedConfig:
    if path is None:
        config = build_config({}, overrides)
        return LoadedConfig(config=config, version=config_digest(config), source="defaults")
    data = read_config_bytes(path)
    config = build_config(parse_config_bytes(data, f"config file {path}"), overrides)
    return LoadedConfig(config=config, version=config_digest(config), source=str(path), file_digest=bytes_digest(data))


def config_digest(config: Config) -> str:
    blob = json.dumps(to_plain(config), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def to_plain(value: Any) -> Any:
    """A JSON-friendly view of a config (for /debug/state and digests)."""
    if isinstance(value, XidRule):
        return value.describe()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [to_plain(v) for v in value]
    return value


# --- semantic checks ---------------------------------------------------------------

MAX_REPLICAS = 1024
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_CDI_VENDOR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")


def check_extended_resource_name(name: str, where: str) -> None:
    """The kubelet's extended-resource rule for device plugin resource names."""
    domain, sep, short = name.partition("/")
    bad = (
        not sep
        or not domain
        or domain == "kubernetes.io"
        or domain.endswith(".kubernetes.io")
        or name.startswith("requests.")
        or len(short) > 63
        or not _QUALIFIED_NAME.fullmatch(short)
        or len(domain) > 253
        or not _DNS_SUBDOMAIN.fullmatch(domain)
    )
    if bad:
        raise ConfigError(
            f"{where}: {name!r} is not a valid extended resource name (want <domain>/<name>, "
            "name at most 63 characters, not in kubernetes.io)"
        )


def check_driver_name(name: str, where: str) -> None:
    """The apiserver's rule for a DRA driver name: a lowercase DNS subdomain of at most 63 characters."""
    if len(name) > 63 or not _DNS_SUBDOMAIN.fullmatch(name):
        raise ConfigError(
            f"{where}: {name!r} is not a valid DRA driver name (a lowercase DNS subdomain of at most 63 "
            "characters, e.g. gpu-node-agent.nvidia.com)"
        )


def check_cdi_kind(kind: str, where: str) -> None:
    vendor, sep, klass = kind.partition("/")
    if not sep or not _CDI_VENDOR_CLASS.fullmatch(vendor) or not _CDI_VENDOR_CLASS.fullmatch(klass):
        raise ConfigError(f"{where}: {kind!r} is not a valid CDI kind (want <vendor>/<class>)")
    if "." in klass:
        # a dotted class needs cdiVersion 0.6.0, which runtimes built on older CDI libraries
        # (Debian's podman 4.3, for one) reject: every spec of that kind would be unusable there
        raise ConfigError(f"{where}: {kind!r}: the class part must not contain '.' (it needs CDI 0.6.0)")


def parse_host_port(addr: str, where: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{where}: expected HOST:PORT, got {addr!r}")
    return host, int(port)


def check_semantics(config: Config) -> None:
    def positive(value: float, where: str) -> None:
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{where}: must be a number greater than 0, got {value!r}")

    parse_host_port(config.debug_addr, "debug_addr")
    positive(config.inventory_refresh_s, "inventory_refresh_s")
    for name in ("kubelet_root", "device_plugins_dir", "cdi_root", "state_dir", "driver_root", "host_driver_root"):
        path = getattr(config.paths, name)
        if path is not None and not path.is_absolute():
            raise ConfigError(f"paths.{name}: must be an absolute path, got {str(path)!r}")
    health = config.health
    positive(health.check_interval_s, "health.check_interval_s")
    if not math.isfinite(health.recovery_quiet_s) or health.recovery_quiet_s < 0:
        raise ConfigError(f"health.recovery_quiet_s: must not be negative, got {health.recovery_quiet_s!r}")
    positive(health.event_wait_ms, "health.event_wait_ms")
    positive(health.history_size, "health.history_size")
    for xid in health.xids:
        if xid < 0:
            raise ConfigError(f"health.xids: Xid numbers are not negative, got {xid}")
    check_extended_resource_name(config.plugin.resource_name, "plugin.resource_name")
    if not config.plugin.device_list_strategy:
        raise ConfigError("plugin.device_list_strategy: name at least one strategy")
    if len(set(config.plugin.device_list_strategy)) != len(config.plugin.device_list_strategy):
        raise ConfigError(f"plugin.device_list_strategy: duplicate entries in {config.plugin.device_list_strategy!r}")
    positive(config.plugin.time_slicing.replicas, "plugin.time_slicing.replicas")
    if config.plugin.time_slicing.replicas > MAX_REPLICAS:
        # every replica is a device in ListAndWatch, whose messages must stay far below the
        # kubelet's 4 MiB gRPC limit
        raise ConfigError(
            f"plugin.time_slicing.replicas: at most {MAX_REPLICAS}, got {config.plugin.time_slicing.replicas}"
        )
    check_driver_name(config.dra.driver_name, "dra.driver_name")
    check_cdi_kind(config.cdi.device_plugin_kind, "cdi.device_plugin_kind")
    check_cdi_kind(config.cdi.claim_kind, "cdi.claim_kind")
    positive(config.cdi.reconcile_interval_s, "cdi.reconcile_interval_s")
    if config.cdi.hook_path is not None and not config.cdi.hook_path.is_absolute():
        raise ConfigError(f"cdi.hook_path: must be an absolute path, got {str(config.cdi.hook_path)!r}")
    positive(config.ownership.handover_warning_s, "ownership.handover_warning_s")
    _check_observability(config)
    for i, rule in enumerate(config.ownership.nodes):
        if not rule.match.names and not rule.match.labels:
            raise ConfigError(f"ownership.nodes[{i}].match: name node names or labels to match")
    _check_dra(config)


#: the largest memory step or default share a config may name (1 TiB; GPUs hold far less)
MAX_SHARE_MIB = 1024 * 1024


def _check_dra(config: Config) -> None:
    for i, publish_rule in enumerate(config.dra.publish.nodes):
        if not publish_rule.match.names and not publish_rule.match.labels:
            raise ConfigError(f"dra.publish.nodes[{i}].match: name node names or labels to match")
    sharing = config.dra.sharing
    for name in ("memory_step_mib", "default_memory_mib"):
        value = getattr(sharing, name)
        if not 1 <= value <= MAX_SHARE_MIB:
            raise ConfigError(f"dra.sharing.{name}: must be between 1 and {MAX_SHARE_MIB}, got {value!r}")
    if sharing.default_memory_mib % sharing.memory_step_mib:
        # the apiserver's rule for a requestPolicy: (default - min) is a multiple of the step
        raise ConfigError(
            f"dra.sharing.default_memory_mib: must be a multiple of memory_step_mib "
            f"({sharing.memory_step_mib}), got {sharing.default_memory_mib}"
        )


#: the shortest sampling and checking intervals: below them the agent would mostly poll itself
MIN_INTERVAL_S = 0.05


def _check_observability(config: Config) -> None:
    def interval(value: float, where: str) -> None:
        if not math.isfinite(value) or value < MIN_INTERVAL_S:
            raise ConfigError(f"{where}: must be a number of seconds, at least {MIN_INTERVAL_S}, got {value!r}")

    def at_least(value: int, least: int, where: str) -> None:
        if value < least:
            raise ConfigError(f"{where}: must be at least {least}, got {value!r}")

    metrics, watchdog, orphans = config.metrics, config.watchdog, config.orphans
    interval(metrics.utilization_interval_s, "metrics.utilization_interval_s")
    at_least(metrics.utilization_stale_intervals, 1, "metrics.utilization_stale_intervals")
    at_least(metrics.max_holder_series, 0, "metrics.max_holder_series")
    interval(watchdog.interval_s, "watchdog.interval_s")
    interval(watchdog.grace_s, "watchdog.grace_s")
    at_least(watchdog.max_repairs, 1, "watchdog.max_repairs")
    interval(orphans.interval_s, "orphans.interval_s")
    at_least(orphans.max_lookups, 1, "orphans.max_lookups")


# --- type-driven conversion -------------------------------------------------------


#: bounds on a config document after YAML aliases are expanded: a real config is a few
#: hundred nodes; these stop "billion laughs" documents and self-referencing aliases
MAX_NODES = 100_000
MAX_DEPTH = 32


def _check_shape(document: Any) -> None:
    stack: list[tuple[Any, int]] = [(document, 0)]
    nodes = 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES or depth > MAX_DEPTH:
            raise ConfigError(
                f"config: document too large or too deeply nested (more than {MAX_NODES} values or "
                f"{MAX_DEPTH} levels; self-referencing YAML aliases?)"
            )
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def _set_dotted(doc: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = doc
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[last] = value


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.-]+")


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, Enum):
        return " | ".join(repr(m.value) for m in tp)
    if isinstance(tp, type):
        return {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false"}.get(
            tp.__name__, tp.__name__
        )
    return str(tp)


def convert(tp: Any, value: Any, where: str) -> Any:
    label = where or "config"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return convert(inner[0], value, where)
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{label}: expected one of {_type_name(tp)}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{label}: expected a list, got {value!r}")
        return tuple(convert(args[0], v, f"{label}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{label}: expected a mapping, got {value!r}")
        key_tp, val_tp = args
        return {convert(key_tp, k, f"{label}[{k!r}]"): convert(val_tp, v, f"{label}[{k!r}]") for k, v in value.items()}
    if isinstance(tp, type) and hasattr(tp, "from_config"):
        return tp.from_config(value, label)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return convert_dataclass(tp, value, where)
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"{label}: expected one of {_type_name(tp)}, got {value!r}") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        text = value.strip() if isinstance(value, str) else ""
        if text.lstrip("-").isascii() and text.lstrip("-").isdecimal() and len(text) <= 18:
            return int(text)
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
    elif tp is Path:
        if isinstance(value, str | Path) and str(value):
            return Path(value)
    else:  # pragma: no cover - a schema type nobody taught the loader
        raise TypeError(f"config loader cannot convert to {tp!r}")
    raise ConfigError(f"{label}: expected {_type_name(tp)}, got {value!r}")


def convert_dataclass(tp: type[Any], value: Any, where: str) -> Any:
    label = where or "config"
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(f"{label}: expected a mapping, got {value!r}")
    hints = typing.get_type_hints(tp)
    fields = {f.name: f for f in dataclasses.fields(tp)}
    for key in value:
        if key not in fields:
            known = ", ".join(sorted(fields))
            shown = key if isinstance(key, str) and _PLAIN_KEY.fullmatch(key) else repr(key)
            raise ConfigError(f"{_join(where, shown)}: unknown field (known fields here: {known})")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in value:
            continue
        converted = convert(hints[name], value[name], _join(where, name))
        if isinstance(converted, dict) and f.default_factory is not dataclasses.MISSING:
            converted = {**f.default_factory(), **converted}
        kwargs[name] = converted
    return tp(**kwargs)
