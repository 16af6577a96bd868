"""Fixtures shared by more than one test file."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from agent.observe.debug.server import DebugContext, serve_debug

DebugClient = Callable[[DebugContext], Awaitable[aiohttp.ClientSession]]


@pytest.fixture
async def debug_client() -> AsyncIterator[DebugClient]:
    """Serves a context on a loopback port; an HTTP client session whose paths are relative to it."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(context: DebugContext) -> aiohttp.ClientSession:
            port = await stack.enter_async_context(serve_debug(context, "127.0.0.1", 0))
            return await stack.enter_async_context(aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}"))

        yield start
