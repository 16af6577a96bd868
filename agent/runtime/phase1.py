"""What phase 1 of start-up hands to phase 2: the options the agent runs with, and the core it built.

Its own module so that ``app`` (phase 1 and the start-up order) and ``assemble`` (phase 2)
both name these types without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from agent.backends.backend import Backend
from agent.cdi.service import CdiProvider
from agent.core.config.current import ConfigState
from agent.core.config.loader import LoadedConfig
from agent.core.node import NodeFacts
from agent.core.ownership.record import RecordKeeper
from agent.core.ownership.table import OwnershipTable
from agent.deviceplugin.manager import PluginManager


@dataclass(frozen=True, slots=True)
class RunOptions:
    config_path: Path | None = None
    #: dotted config paths set by flags and GPU_AGENT_* variables; they win over the file
    overrides: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Core:
    """What phase 1 builds: everything the device plugin needs."""

    loaded: LoadedConfig
    node_name: str
    backend: Backend
    node: NodeFacts
    config_state: ConfigState
    registry: CollectorRegistry
    cdi: CdiProvider
    plugin: PluginManager
    #: the durable record of the device plugin's grants, and the grants made from it at start
    record: RecordKeeper
    seed: OwnershipTable | None
