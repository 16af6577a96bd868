"""The opaque device configuration this driver reads from claims and device classes.

A claim (or its DeviceClass) may carry, for this driver::

    opaque:
      driver: <dra.driver_name>
      parameters:
        apiVersion: gpu-node-agent.nvidia.com/v1alpha1
        kind: GpuConfig
        env:                      # extra environment variables in the containers that
          NCCL_DEBUG: INFO        # get the devices this config applies to

``env`` is the one setting: it is enforced for real, through the claim's CDI spec. (A
time-slicing or sharing setting is left out on purpose: nothing in this agent can make a GPU
honour it, and a setting that is accepted but not applied would be a lie.)

Every problem is a :class:`~agent.dra.claims.errors.ClaimError` naming the config and the field:
an unknown apiVersion, kind or field, a value of the wrong type, a bad or reserved variable
name, too many or too long values. Names the driver itself sets (``NVIDIA_*``,
``GPU_AGENT_*``, ``CUDA_VISIBLE_DEVICES``, and ``CUDA_MPS_*`` for shares under MPS) are
reserved: overriding them would contradict the devices the container is given.

Precedence (a driver convention; Kubernetes leaves it to drivers): configs from the class
apply first, then the claim's, each in listed order; a later value of a variable wins. A
config with no ``requests`` applies to every device; one naming ``<main>`` applies to that
request and its subrequests; one naming ``<main>/<sub>`` applies to that subrequest only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.dra.claims.errors import ClaimError, Reason, quote
from agent.kube.claims.model import OpaqueConfig

API_VERSION = "gpu-node-agent.nvidia.com/v1alpha1"
KIND = "GpuConfig"
FIELDS = ("apiVersion", "kind", "env")

MAX_PARAMETERS_BYTES = 16 * 1024  # the API server allows 10 KiB; a bound of our own all the same
MAX_ENV = 32
MAX_NAME = 128
MAX_VALUE = 4096
RESERVED_PREFIXES = ("NVIDIA_", "GPU_AGENT_", "CUDA_MPS_")
RESERVED_NAMES = frozenset({"CUDA_VISIBLE_DEVICES"})
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SOURCE_ORDER = {"FromClass": 0, "FromClaim": 1}


@dataclass(frozen=True, slots=True)
class GpuConfig:
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ScopedConfig:
    """One parsed config of this driver with the requests it applies to."""

    requests: tuple[str, ...]
    config: GpuConfig

    def applies_to(self, request: str) -> bool:
        if not self.requests:
            return True
        return request in self.requests or request.partition("/")[0] in self.requests


def reserved(name: str) -> bool:
    return name in RESERVED_NAMES or name.startswith(RESERVED_PREFIXES)


def _bad(where: str, problem: str) -> ClaimError:
    return ClaimError(Reason.BAD_CONFIG, f"{where}: {problem}", recoverable=False)


def parse_gpu_config(parameters: Any, where: str) -> GpuConfig:
    """Validate one ``parameters`` object; raises ClaimError(BAD_CONFIG) naming the field."""
    if not isinstance(parameters, Mapping):
        raise _bad(where, f"parameters must be an object, got {type(parameters).__name__}")
    try:
        size = len(json.dumps(parameters, ensure_ascii=False).encode())
    except (TypeError, ValueError) as exc:
        raise _bad(where, f"parameters are not JSON data: {exc}") from exc
    if size > MAX_PARAMETERS_BYTES:
        raise _bad(where, f"parameters are {size} bytes, at most {MAX_PARAMETERS_BYTES} allowed")
    for key in parameters:
        if key not in FIELDS:
            raise _bad(where, f"unknown field {quote(key)} ({KIND} has {', '.join(FIELDS)})")
    api_version = parameters.get("apiVersion")
    if api_version != API_VERSION:
        raise _bad(where, f"apiVersion: unsupported {quote(api_version)}, this driver reads {API_VERSION}")
    kind = parameters.get("kind")
    if kind != KIND:
        raise _bad(where, f"kind: unsupported {quote(kind)}, this driver reads {KIND}")
    return GpuConfig(env=_parse_env(parameters.get("env", {}), f"{where}: env"))


def _parse_env(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _bad(where, f"must be an object of NAME: value, got {type(value).__name__}")
    if len(value) > MAX_ENV:
        raise _bad(where, f"{len(value)} variables, at most {MAX_ENV} allowed")
    env: dict[str, str] = {}
    for name, text in value.items():
        if not isinstance(name, str) or len(name) > MAX_NAME or not _NAME.fullmatch(name):
            raise _bad(where, f"invalid variable name {quote(name)} (letters, digits, _; not starting with a digit)")
        if reserved(name):
            raise _bad(
                f"{where}.{name}", "reserved for the driver (NVIDIA_*, GPU_AGENT_*, CUDA_MPS_*, CUDA_VISIBLE_DEVICES)"
            )
        if not isinstance(text, str):
            raise _bad(f"{where}.{name}", f"value must be a string, got {type(text).__name__}")
        if len(text) > MAX_VALUE or "\x00" in text:
            raise _bad(f"{where}.{name}", f"value longer than {MAX_VALUE} characters or with a NUL byte")
        env[name] = text
    return env


def driver_configs(configs: Iterable[OpaqueConfig], driver: str) -> list[ScopedConfig]:
    """This driver's configs, parsed, in precedence order (class first, then claim)."""
    ours = [(i, c) for i, c in enumerate(configs) if c.driver == driver]
    ours.sort(key=lambda item: (_SOURCE_ORDER.get(item[1].source, 2), item[0]))
    out = []
    for index, config in ours:
        where = f"opaque config #{index} ({config.source or 'unknown source'})"
        out.append(ScopedConfig(requests=tuple(config.requests), config=parse_gpu_config(config.parameters, where)))
    return out


def env_for(configs: Sequence[ScopedConfig], request: str) -> dict[str, str]:
    """The variables for a device allocated for ``request`` (``<main>`` or ``<main>/<sub>``)."""
    env: dict[str, str] = {}
    for scoped in configs:
        if scoped.applies_to(request):
            env.update(scoped.config.env)
    return env
