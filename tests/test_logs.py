"""Logging set-up: a call below the level in force costs no processing; request IDs are short and unique."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest
import structlog

from agent.base.logs import Persistent, configure_logging, debug_enabled, next_request_id, set_level


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    out = io.StringIO()
    configure_logging("info", stream=out, json=True)
    try:
        yield out
    finally:
        root = logging.getLogger()
        root.handlers.clear()
        root.setLevel(logging.WARNING)
        structlog.reset_defaults()


def test_debug_below_the_level_never_reaches_the_processors(stream: io.StringIO) -> None:
    seen: list[str] = []

    def spy(logger: object, method: str, event: dict[str, object]) -> dict[str, object]:
        seen.append(str(event["event"]))
        return event

    processors = structlog.get_config()["processors"]
    processors.insert(len(processors) - 1, spy)  # just before the hand-over to stdlib logging
    log = structlog.get_logger("agent.test")
    log.debug("hidden", field="v")
    log.info("shown", field="v")
    assert seen == ["shown"]
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["shown"]
    assert lines[0]["level"] == "info" and lines[0]["logger"] == "agent.test"


def test_debug_enabled_follows_the_level_live(stream: io.StringIO) -> None:
    check = debug_enabled("agent.test")
    assert not check()
    set_level("debug")
    assert check()
    structlog.get_logger("agent.test").debug("now shown")
    assert json.loads(stream.getvalue().splitlines()[-1])["event"] == "now shown"
    set_level("info")
    assert not check()


def test_request_ids_are_twelve_hex_digits_and_do_not_repeat() -> None:
    ids = [next_request_id() for _ in range(10_000)]
    assert all(re.fullmatch(r"[0-9a-f]{12}", i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_the_agent_loads_without_rich_until_someone_asks_for_it() -> None:
    """structlog is imported with rich hidden (5 MiB at every start); typer can still load it."""
    import subprocess
    import sys

    code = (
        "import sys, agent.runtime.app, agent.cli.main; assert 'rich' not in sys.modules, 'rich loaded'; "
        "import rich.console; print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_persistent_condition_is_news_once_and_again_when_it_changes() -> None:
    noise = Persistent()
    levels = [noise.level(c) for c in ("no kubelet", "no kubelet", "no kubelet", "refused", "refused")]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG, logging.WARNING, logging.DEBUG]
    noise.clear()  # the condition ended (registered): its return is news
    assert noise.level("refused") == logging.WARNING
