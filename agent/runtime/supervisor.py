"""Root tasks under one supervisor: named, guarded, and stopped together.

Each root task runs behind :func:`guard`: a failure, or a return from a task that should run
forever, becomes :class:`AgentCrashed`, which cancels every other root task and stops the agent
in order (the DaemonSet restarts it). Tasks start one by one (:meth:`Supervisor.start`), so the
composition root can start the device plugin before the rest of the agent is even built.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import structlog

from agent.base.errors import AgentError

log = structlog.get_logger("agent")


class AgentCrashed(AgentError):
    """A root task failed or ended; the agent stopped."""


async def guard(name: str, work: Callable[[], Awaitable[None]]) -> None:
    """Run a root task; a failure or an unexpected return becomes AgentCrashed."""
    try:
        await work()
    except asyncio.CancelledError:
        raise
    except AgentError as exc:
        log.error("task failed", task=name, error=str(exc))
        raise AgentCrashed(f"{name} failed: {exc}") from exc
    except Exception as exc:
        log.exception("task crashed", task=name)
        raise AgentCrashed(f"{name} crashed: {type(exc).__name__}: {exc}") from exc
    log.error("task ended unexpectedly", task=name)
    raise AgentCrashed(f"{name} ended unexpectedly")


class Supervisor:
    """Root tasks of one TaskGroup, each behind :func:`guard`; started one by one."""

    def __init__(self, group: asyncio.TaskGroup) -> None:
        self._group = group
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, name: str, work: Callable[[], Awaitable[None]]) -> None:
        self.tasks.append(self._group.create_task(guard(name, work), name=name))


@contextlib.asynccontextmanager
async def supervised() -> AsyncIterator[Supervisor]:
    """Run root tasks until the body returns (then cancel them) or one of them fails.

    A failing root task cancels the others and the body, and comes out as one
    :class:`AgentCrashed`; an AgentError raised by the body itself (a start-up failure while
    the first roots already run) comes out as itself, one line.
    """
    # ``except BaseExceptionGroup`` and split(), not ``except*``: before Python 3.11.4 an
    # exception raised inside an ``except*`` clause comes out wrapped in an ExceptionGroup
    # (CPython gh-103590), and the user would see a 90-line traceback instead of one line.
    try:
        async with asyncio.TaskGroup() as group:
            supervisor = Supervisor(group)
            yield supervisor
            for task in supervisor.tasks:
                task.cancel()
    except BaseExceptionGroup as errors:
        crashed, rest = errors.split(AgentCrashed)
        failed, rest = rest.split(AgentError) if rest is not None else (None, None)
        if rest is not None:
            raise  # something that is not ours (a bug, KeyboardInterrupt): keep all of it
        if crashed is not None:
            first = _first_leaf(crashed)
            raise AgentCrashed(str(first)) from first
        assert failed is not None
        raise _first_leaf(failed) from None


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first exception in a (possibly nested) group."""
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


async def supervise(roots: Mapping[str, Callable[[], Awaitable[None]]], stop: asyncio.Event) -> None:
    """Run ``roots`` until ``stop`` is set (or one of them fails)."""
    async with supervised() as supervisor:
        for name, work in roots.items():
            supervisor.start(name, work)
        await stop.wait()
        log.info("stopping")
