"""NVML error codes and their translation into the agent's typed, one-line errors.

The codes are NVML's C ABI (``nvmlReturn_t``), identical in every pynvml release, so the
helpers compare ``NVMLError.value`` against them instead of depending on which error
subclasses a given binding generates. The module object is still passed in because
``NVMLError`` itself belongs to it (tests inject a fake module).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from agent.base.errors import (
    BackendError,
    BackendInitError,
    DeviceNotFoundError,
    GpuLostError,
    LibraryMissingError,
    NotSupportedError,
)

ERROR_UNINITIALIZED = 1
ERROR_INVALID_ARGUMENT = 2
ERROR_NOT_SUPPORTED = 3
ERROR_NO_PERMISSION = 4
ERROR_NOT_FOUND = 6
ERROR_DRIVER_NOT_LOADED = 9
ERROR_TIMEOUT = 10
ERROR_LIBRARY_NOT_FOUND = 12
ERROR_FUNCTION_NOT_FOUND = 13
ERROR_GPU_IS_LOST = 15
ERROR_RESET_REQUIRED = 16
ERROR_IN_USE = 19
ERROR_INSUFFICIENT_RESOURCES = 23
ERROR_UNKNOWN = 999

#: the query does not exist for this device or driver: callers skip the field
NOT_SUPPORTED_CODES = frozenset({ERROR_NOT_SUPPORTED, ERROR_FUNCTION_NOT_FOUND})

LIBRARY_MISSING_MESSAGE = (
    "NVML library libnvidia-ml.so.1 not found: is the NVIDIA driver installed and visible to the agent?"
)


def nvml_code(nvml: ModuleType, exc: BaseException) -> int | None:
    """The ``nvmlReturn_t`` of an NVML error, or None when ``exc`` is not one."""
    if not isinstance(exc, nvml.NVMLError):
        return None
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def describe(nvml: ModuleType, exc: BaseException) -> str:
    """A short, single-line description of an NVML (or other) error."""
    code = nvml_code(nvml, exc)
    try:
        text = str(exc)
    except Exception:  # pynvml's __str__ may call into the library for unknown codes
        text = ""
    text = " ".join(text.split()) or type(exc).__name__
    return f"{text} (NVML error {code})" if code is not None else text


def translate(nvml: ModuleType, exc: BaseException, doing: str) -> BackendError:
    """The typed error for an NVML failure while ``doing`` (e.g. "GPU 3: reading memory info")."""
    code = nvml_code(nvml, exc)
    message = f"{doing}: {describe(nvml, exc)}"
    if code == ERROR_LIBRARY_NOT_FOUND:
        return LibraryMissingError(LIBRARY_MISSING_MESSAGE)
    if code == ERROR_GPU_IS_LOST:
        return GpuLostError(message)
    if code in (ERROR_NOT_FOUND, ERROR_INVALID_ARGUMENT):
        return DeviceNotFoundError(message)
    if code in NOT_SUPPORTED_CODES:
        return NotSupportedError(message)
    return BackendError(message)


def translate_init(nvml: ModuleType, exc: BaseException) -> BackendError:
    """The typed error for a failed ``nvmlInit``: library missing, or any other init failure."""
    if nvml_code(nvml, exc) == ERROR_LIBRARY_NOT_FOUND:
        return LibraryMissingError(LIBRARY_MISSING_MESSAGE)
    return BackendInitError(f"NVML did not initialise: {describe(nvml, exc)}")


def optional_call(nvml: ModuleType, fn: Callable[..., Any] | None, *args: Any) -> Any:
    """``fn(*args)``; None when the binding lacks the function or the device does not support it."""
    if fn is None:
        return None
    try:
        return fn(*args)
    except nvml.NVMLError as exc:
        if nvml_code(nvml, exc) in NOT_SUPPORTED_CODES:
            return None
        raise
