"""Checks of a config against the flags it came with."""

from __future__ import annotations

from agent.base.errors import ConfigError
from agent.core.config.schema import Config


def check_preset_flag(preset: str | None, config: Config) -> None:
    """A ``--preset`` flag names a simulated node: refuse it unless the backend is simulated.

    Simulated GPUs are only ever chosen explicitly, so the flag does not imply ``--simulated``
    (on a real GPU node that would quietly show made-up GPUs); ignoring it would be worse.
    """
    if preset is not None and config.backend != "simulated":
        raise ConfigError(
            f"--preset {preset} describes a simulated node, but the backend is {config.backend}: add --simulated"
        )
