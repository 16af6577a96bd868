"""structlog, configured once: JSON lines off a terminal, readable console output on one.

Standard-library loggers (aiohttp, grpclib, asyncio) are bridged into the same output so
that one process writes one format.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(level: str = "info", *, stream: TextIO | None = None, json: bool | None = None) -> None:
    """Configure structlog and the stdlib root logger. Safe to call again (e.g. new level)."""
    stream = stream or sys.stderr
    if json is None:
        json = not stream.isatty()
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info if json else structlog.processors.StackInfoRenderer(),
            renderer,
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS.get(level, logging.INFO))
    # aiohttp's access log is noise for a local debug endpoint
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def set_level(level: str) -> None:
    """Change the level of every logger at run time (config ``log_level``, applied live)."""
    logging.getLogger().setLevel(_LEVELS.get(level, logging.INFO))


class LogThrottle:
    """At most one log line per ``every_s`` for a repeated event; each line says how many it stands for."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._every_s = every_s
        self._clock = clock
        self._next = 0.0
        self._folded = 0

    def due(self) -> int:
        """0 if this occurrence is folded into a later line; else how many occurrences to report."""
        self._folded += 1
        now = self._clock()
        if now < self._next:
            return 0
        self._next = now + self._every_s
        count, self._folded = self._folded, 0
        return count
