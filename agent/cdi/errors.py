"""Domain errors of the CDI package; each message names the path or name at fault."""

from __future__ import annotations

from agent.base.errors import AgentError


class CdiError(AgentError):
    """Base for CDI failures."""


class InvalidNameError(CdiError):
    """A vendor, class, device name or claim UID breaks the CDI name rules."""


class InvalidSpecError(CdiError):
    """A spec document does not parse or does not validate."""

    def __init__(self, message: str, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems or (message,)


class DriverDiscoveryError(CdiError):
    """The driver root lacks a required piece, or is ambiguous (two driver versions)."""

    recoverable = True  # a driver container may still be installing


class SpecWriteError(CdiError):
    """A spec file could not be written or removed; nothing already on disk was damaged."""

    recoverable = True


class SpecConflictError(SpecWriteError):
    """Another file in the CDI directory defines the same qualified device names."""


class UnknownCdiDeviceError(CdiError, KeyError):
    """A device UUID or index has no device in the current spec."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""
