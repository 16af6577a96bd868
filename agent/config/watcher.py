"""Live reload of the config file (a mounted ConfigMap).

The kubelet updates a ConfigMap volume by writing a new timestamped directory and renaming
the ``..data`` symlink over the old one, so the watcher listens on the directory that holds
the file, not on the file: any change there triggers a re-read, and a re-read whose bytes
are unchanged does nothing. A bad update is logged and counted, and the last good config
stays in force.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

from agent.config.loader import (
    LoadedConfig,
    build_config,
    bytes_digest,
    config_digest,
    parse_config_bytes,
    read_config_bytes,
)
from agent.config.schema import RESTART_ONLY_FIELDS, Config
from agent.config.state import ConfigState
from agent.errors import ConfigError
from agent.fswatch import DirectoryWatcher

log = structlog.get_logger("agent.config")

#: Called with a validated candidate before it is installed; raising ConfigError rejects it
#: (e.g. an ownership override naming a GPU this node does not have).
Validator = Callable[[LoadedConfig], None]


def keep_restart_only(old: Config, new: Config) -> tuple[Config, list[str]]:
    """``new`` with the fields that need a restart taken from ``old``; names those that differed."""
    changed = [name for name in RESTART_ONLY_FIELDS if getattr(old, name) != getattr(new, name)]
    if not changed:
        return new, []
    kept: dict[str, Any] = {name: getattr(old, name) for name in changed}
    return dataclasses.replace(new, **kept), changed


class ConfigWatcher:
    def __init__(
        self,
        *,
        path: Path,
        overrides: Mapping[str, Any],
        state: ConfigState,
        validate: Validator,
        resync_interval_s: float = 30.0,
        settle_s: float = 0.1,
    ) -> None:
        self._path = path
        self._overrides = dict(overrides)
        self._state = state
        self._validate = validate
        self._resync_interval_s = resync_interval_s
        self._settle_s = settle_s
        # the bytes the running config was parsed from: an update that landed while the agent
        # was starting (after that parse, before this watcher existed) is still news
        self._last_bytes_digest = state.loaded.file_digest
        self._candidate_rejected = False

    async def run(self) -> None:
        """Watch until cancelled. Events are the fast path; a slow resync covers missed ones.

        After an event the watcher waits for the directory to be quiet for ``settle_s`` before
        reading, so a file written in several steps (an editor, ``cat > file``) is read whole.
        ConfigMap updates are atomic and lose only that moment.
        """
        async with DirectoryWatcher(self._path.parent) as watcher:
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._resync_interval_s):
                        await anext(watcher)
                        await self._settle(watcher)
                self.check()

    async def _settle(self, watcher: DirectoryWatcher) -> None:
        while True:
            try:
                async with asyncio.timeout(self._settle_s):
                    await anext(watcher)
            except TimeoutError:
                return

    def check(self) -> bool:
        """Re-read the file if its bytes changed; returns whether a new config was installed."""
        # one read: the bytes compared are the bytes parsed
        unreadable: ConfigError | None = None
        try:
            data = read_config_bytes(self._path)
            digest = bytes_digest(data)
        except ConfigError as exc:
            data, digest, unreadable = b"", f"unreadable: {exc}", exc
        if digest == self._last_bytes_digest:
            return False
        self._last_bytes_digest = digest
        try:
            if unreadable is not None:
                raise unreadable
            if not data.strip():
                # almost always a write caught half-way; "all defaults" would flip every owner
                raise ConfigError(f"config file {self._path} is empty (write '{{}}' to go back to the defaults)")
            candidate = self._load(data, digest)
            self._validate(candidate)
        except ConfigError as exc:
            self._candidate_rejected = True
            self._state.reject(str(exc))
            log.error(
                "config update rejected, keeping the last good config",
                error=str(exc),
                version=self._state.loaded.version,
                path=str(self._path),
            )
            return False
        self._candidate_rejected = False
        installed = self._state.accept(candidate)
        if installed:
            log.info("config update applied", version=candidate.version, path=str(self._path))
        return installed

    def retry(self) -> bool:
        """The node changed (inventory, labels): a file rejected only because it did not fit
        the node may fit now, so read it again even though its bytes are the same."""
        if not self._candidate_rejected:
            return False
        self._last_bytes_digest = ""
        return self.check()

    def _load(self, data: bytes, digest: str) -> LoadedConfig:
        document = parse_config_bytes(data, f"config file {self._path}")
        config = build_config(document, self._overrides)
        config, restart_only = keep_restart_only(self._state.config, config)
        if restart_only:
            log.warning(
                "config fields changed that take effect only on restart; keeping the running values",
                fields=restart_only,
            )
        return LoadedConfig(config=config, version=config_digest(config), source=str(self._path), file_digest=digest)
