"""Root tasks: one failing or ending stops the agent in order; a stop request ends it cleanly."""

from __future__ import annotations

import asyncio

import pytest

from agent.base.errors import BackendError
from agent.runtime.supervisor import AgentCrashed, supervise, supervised


async def forever(cancelled: list[str], name: str) -> None:
    try:
        await asyncio.Event().wait()
    finally:
        cancelled.append(name)


async def test_a_crashing_task_stops_the_others() -> None:
    cancelled: list[str] = []

    async def crash() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("boom")

    roots = {"a": lambda: forever(cancelled, "a"), "b": lambda: forever(cancelled, "b"), "bad": crash}
    with pytest.raises(AgentCrashed, match="bad crashed: RuntimeError: boom"):
        await asyncio.wait_for(supervise(roots, asyncio.Event()), 5)
    assert sorted(cancelled) == ["a", "b"]


async def test_an_agent_error_is_reported_in_one_line() -> None:
    async def lost() -> None:
        raise BackendError("GPU-1 fell off the bus")

    with pytest.raises(AgentCrashed, match=r"^health-watch failed: GPU-1 fell off the bus$"):
        await asyncio.wait_for(supervise({"health-watch": lost}, asyncio.Event()), 5)


async def test_a_task_that_returns_is_a_crash_too() -> None:
    cancelled: list[str] = []

    async def quits() -> None:
        return None

    with pytest.raises(AgentCrashed, match="quits ended unexpectedly"):
        await asyncio.wait_for(supervise({"quits": quits, "a": lambda: forever(cancelled, "a")}, asyncio.Event()), 5)
    assert cancelled == ["a"]


async def test_stop_cancels_everything_and_returns() -> None:
    cancelled: list[str] = []
    stop = asyncio.Event()
    task = asyncio.create_task(supervise({"a": lambda: forever(cancelled, "a")}, stop))
    await asyncio.sleep(0)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert cancelled == ["a"]


async def test_a_start_up_failure_in_the_body_comes_out_as_itself() -> None:
    """Not wrapped in an ExceptionGroup: on Python before 3.11.4 ``except*`` wrapped it."""
    cancelled: list[str] = []
    with pytest.raises(BackendError) as raised:
        async with supervised() as supervisor:
            supervisor.start("a", lambda: forever(cancelled, "a"))
            await asyncio.sleep(0)
            raise BackendError("debug endpoint cannot listen")
    assert type(raised.value) is BackendError and str(raised.value) == "debug endpoint cannot listen"
    assert cancelled == ["a"]


async def test_a_bug_in_the_body_keeps_its_traceback() -> None:
    with pytest.raises(BaseExceptionGroup) as raised:
        async with supervised():
            raise ZeroDivisionError
    assert raised.group_contains(ZeroDivisionError)
