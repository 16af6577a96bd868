"""The config in force, and a feed of accepted changes."""

from __future__ import annotations

from agent.base.feeds import Broadcast
from agent.core.config.loader import LoadedConfig
from agent.core.config.schema import Config


class ConfigState:
    """Holds the last good config. Only the watcher (or a test) calls ``accept``/``reject``."""

    def __init__(self, loaded: LoadedConfig) -> None:
        self.loaded = loaded
        self.last_error = ""
        self.reloads = 0
        self.rejections = 0
        self.changes: Broadcast[LoadedConfig] = Broadcast()

    @property
    def config(self) -> Config:
        return self.loaded.config

    def accept(self, loaded: LoadedConfig) -> bool:
        """Install a new config; publishes and returns True only if it differs."""
        self.last_error = ""
        if loaded.version == self.loaded.version:
            return False
        self.loaded = loaded
        self.reloads += 1
        self.changes.publish(loaded)
        return True

    def reject(self, error: str) -> None:
        self.last_error = error
        self.rejections += 1
