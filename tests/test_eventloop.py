"""Which event loop the agent runs on (GPU_AGENT_EVENT_LOOP)."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from agent.base.errors import ConfigError
from agent.runtime import eventloop
from tests.agentproc import run_cli


@pytest.mark.parametrize(
    ("value", "loop"), [("", "uvloop"), ("auto", "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")]
)
def test_choice(value: str, loop: str) -> None:
    assert eventloop.chosen({"GPU_AGENT_EVENT_LOOP": value}) == loop


def test_a_bad_value_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match="GPU_AGENT_EVENT_LOOP: expected one of auto, uvloop, asyncio, got 'trio'"):
        eventloop.chosen({"GPU_AGENT_EVENT_LOOP": "trio"})


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_run_uses_the_chosen_loop(loop: str) -> None:
    async def which() -> bool:
        return isinstance(asyncio.get_running_loop(), uvloop.Loop)

    assert eventloop.run(which(), loop=loop) is (loop == "uvloop")


def test_gpu_agent_run_refuses_a_bad_value_in_one_line() -> None:
    result = run_cli("run", "--simulated", env={"GPU_AGENT_EVENT_LOOP": "trio"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpu-agent: error: GPU_AGENT_EVENT_LOOP: expected one of auto, uvloop, asyncio, got 'trio'"
    ]
