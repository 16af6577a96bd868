"""Which event loop runs the agent: uvloop where it is installed, the standard one otherwise.

uvloop (libuv, in C) cuts the loop's own share of every gRPC call; the agent relies on nothing
that only the standard loop has (signal handlers, ``add_reader`` for inotify, worker threads
and subprocesses all work on both). ``GPU_AGENT_EVENT_LOOP=asyncio`` picks the standard loop
anyway, for a comparison or should uvloop misbehave somewhere; any other value is an error.
This is read from the environment, not the config file, because the loop exists before the
config is read.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

from agent.base.errors import ConfigError

T = TypeVar("T")

ENV = "GPU_AGENT_EVENT_LOOP"
CHOICES = ("auto", "uvloop", "asyncio")


def chosen(environ: dict[str, str] | None = None) -> str:
    """``uvloop`` or ``asyncio``, from ``GPU_AGENT_EVENT_LOOP`` (default ``auto``)."""
    value = (os.environ if environ is None else environ).get(ENV, "") or "auto"
    if value not in CHOICES:
        raise ConfigError(f"{ENV}: expected one of {', '.join(CHOICES)}, got {value[:40]!r}")
    if value == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if value == "uvloop":
            raise ConfigError(f"{ENV}=uvloop, but uvloop is not installed") from None
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T], *, loop: str | None = None) -> T:
    """``asyncio.run(main)`` on the chosen loop."""
    if (loop or chosen()) == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
