"""structlog, configured once: JSON lines off a terminal, readable console output on one.

Standard-library loggers (grpclib, asyncio) are bridged into the same output so
that one process writes one format. A structlog call below the level in force costs one level
check (``filter_by_level`` comes first), not the processor chain; hot paths that would build
their event's fields guard with :func:`debug_enabled`.
"""

from __future__ import annotations

import itertools
import logging
import secrets
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
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
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


class Persistent:
    """A condition that can last (no kubelet, a socket that cannot be made): news the first time
    and whenever it changes, logged at the caller's level; the same again is logged at debug.

    ``level(condition)`` is the stdlib level for this occurrence (``log.log(level, ...)``);
    ``clear()`` when the condition has ended, so that its return is news again.
    """

    def __init__(self, level: int = logging.WARNING) -> None:
        self._level = level
        self._said: str | None = None

    def level(self, condition: str) -> int:
        if condition == self._said:
            return logging.DEBUG
        self._said = condition
        return self._level

    def clear(self) -> None:
        self._said = None


def debug_enabled(logger_name: str) -> Callable[[], bool]:
    """A cheap check for hot paths: whether ``logger_name`` logs at debug now (follows
    :func:`set_level` live). Reads the effective level, as ``filter_by_level`` does."""
    logger = logging.getLogger(logger_name)
    return lambda: not logger.disabled and logger.getEffectiveLevel() <= logging.DEBUG


_REQUEST_PREFIX = secrets.randbits(16)
_request_numbers = itertools.count()


def next_request_id() -> str:
    """A 12-hex-digit ID for one RPC's log lines: a per-process random prefix and a counter
    (a uuid4 per call costs more than the rest of the request's logging context)."""
    return f"{_REQUEST_PREFIX:04x}{next(_request_numbers) & 0xFFFFFFFF:08x}"
