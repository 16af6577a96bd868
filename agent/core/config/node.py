"""Which node the agent runs on, and whether its labels matter to the ownership config."""

from __future__ import annotations

import os
import socket

from agent.core.config.schema import Config, OwnershipConfig


def resolve_node_name(config: Config) -> str:
    """``node_name`` from the config (flag, env), else ``NODE_NAME``, else the host name."""
    return config.node_name or os.environ.get("NODE_NAME", "") or socket.gethostname()


def uses_label_rules(config: OwnershipConfig) -> bool:
    """Whether any ownership rule matches nodes by label (then the Node's labels matter)."""
    return any(rule.match.labels for rule in config.nodes)
