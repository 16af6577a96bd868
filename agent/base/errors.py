"""Typed errors. Each carries a one-line message fit for a user; none needs a traceback."""

from __future__ import annotations


class AgentError(Exception):
    """Base for every error the agent reports to a user in one line."""

    #: whether retrying the same operation later can succeed
    recoverable: bool = False


class ConfigError(AgentError):
    """A config file or flag is wrong; the message names the field and the value."""


class BackendError(AgentError):
    """The device backend failed."""


class LibraryMissingError(BackendError):
    """The NVML library (libnvidia-ml.so.1) cannot be loaded."""


class BackendInitError(BackendError):
    """NVML was found but would not initialise."""


class DeviceNotFoundError(BackendError):
    """A device named by UUID or index is not on this node."""


class GpuLostError(BackendError):
    """A GPU stopped answering (fell off the bus, driver reports it lost)."""

    recoverable = True


class NotSupportedError(BackendError):
    """The device or driver does not support the query; callers usually skip the field."""


class StartupError(AgentError):
    """A component could not start (port in use, unwritable directory, ...)."""
