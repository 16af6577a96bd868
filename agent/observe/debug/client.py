"""Read a running agent's ``/debug/state`` (``gpu-agent status`` and ``config plan`` do)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from agent.base.errors import AgentError

#: how long a command waits for the running agent's debug endpoint
AGENT_TIMEOUT_S = 2.0
#: the most of the agent's answer read (a node's state is tens of KiB)
MAX_STATE_BYTES = 8 * 1024 * 1024


class AgentUnreachable(AgentError):
    """No running agent answered on the debug address."""


def fetch_agent_state(debug_addr: str, timeout_s: float = AGENT_TIMEOUT_S) -> dict[str, Any]:
    """GET ``/debug/state`` of a running agent; AgentUnreachable when none answers."""
    url = f"http://{debug_addr}/debug/state"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            body = resp.read(MAX_STATE_BYTES + 1)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise AgentUnreachable(f"no agent answered at {url}: {getattr(exc, 'reason', exc)}") from exc
    if len(body) > MAX_STATE_BYTES:
        raise AgentUnreachable(f"{url}: answer larger than {MAX_STATE_BYTES} bytes")
    try:
        state = json.loads(body)
    except ValueError as exc:
        raise AgentUnreachable(f"{url}: not a gpu-node-agent state document") from exc
    if not isinstance(state, dict) or not isinstance(state.get("devices"), list):
        raise AgentUnreachable(f"{url}: not a gpu-node-agent state document")
    return state
