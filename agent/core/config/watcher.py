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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from agent.base.errors import ConfigError
from agent.base.fswatch import DirectoryWatcher
from agent.core.config.current import ConfigState
from agent.core.config.loader import (
    LoadedConfig,
    build_config,
    bytes_digest,
    config_digest,
    parse_config_bytes,
    read_config_bytes,
)
from agent.core.config.schema import RESTART_ONLY_FIELDS, Config

log = structlog.get_logger("agent.config")


def keep_restart_only(old: Config, new: Config) -> tuple[Config, list[str]]:
    """``new`` with the fields that need a restart taken from ``old``; names those that differed."""
    changed = [name for name in RESTART_ONLY_FIELDS if _field(old, name) != _field(new, name)]
    kept: Any = new
    for name in changed:
        kept = _replaced(kept, name.split("."), _field(old, name))
    return kept, changed


def _field(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def _replaced(config: Any, path: list[str], value: Any) -> Any:
    """``config`` with the field at ``path`` (a section's field for a dotted name) set to ``value``."""
    head, *rest = path
    return dataclasses.replace(config, **{head: _replaced(getattr(config, head), rest, value) if rest else value})


@dataclass(frozen=True, slots=True)
class _Candidate:
    """What a worker thread made of the file: its digest, and a config or the error it gave."""

    digest: str
    loaded: LoadedConfig | None = None
    error: ConfigError | None = None
    restart_only: tuple[str, ...] = ()


class ConfigWatcher:
    def __init__(
        self,
        *,
        path: Path,
        overrides: Mapping[str, Any],
        state: ConfigState,
        resync_interval_s: float = 30.0,
        settle_s: float = 0.1,
    ) -> None:
        self._path = path
        self._overrides = dict(overrides)
        self._state = state
        self._resync_interval_s = resync_interval_s
        self._settle_s = settle_s
        # the bytes the running config was parsed from: an update that landed while the agent
        # was starting (after that parse, before this watcher existed) is still news
        self._last_bytes_digest = state.loaded.file_digest
        self._checking = asyncio.Lock()

    async def run(self) -> None:
        """Watch until cancelled. Events are the fast path; a slow resync covers missed ones.

        After an event the watcher waits for the directory to be quiet for ``settle_s`` before
        reading, so a file written in several steps (an editor, ``cat > file``) is read whole.
        ConfigMap updates are atomic and lose only that moment.
        """
        async with DirectoryWatcher(self._path.parent) as watcher:
            while True:
                await self._next_trigger(watcher)
                await self.check()

    async def _next_trigger(self, watcher: DirectoryWatcher) -> None:
        """Return once a change has settled or the resync interval passed."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._resync_interval_s):
                await self._settled_change(watcher)

    async def _settled_change(self, watcher: DirectoryWatcher) -> None:
        await anext(watcher)
        while True:
            try:
                async with asyncio.timeout(self._settle_s):
                    await anext(watcher)
            except TimeoutError:
                return

    async def check(self) -> bool:
        """Re-read the file if its bytes changed; returns whether a new config was installed.

        Reading and parsing run in a worker thread: the file is at most 1 MiB, but YAML that
        size takes seconds to parse. Installing runs here. Nothing about the node can make a
        valid file invalid (an override naming a GPU the node lacks is inert, not an error), so
        a file is judged by its bytes alone.
        """
        async with self._checking:
            candidate = await asyncio.to_thread(self._read, self._last_bytes_digest, self._state.config)
            if candidate is None:
                return False
            self._last_bytes_digest = candidate.digest
            try:
                if candidate.error is not None:
                    raise candidate.error
                assert candidate.loaded is not None
                if candidate.restart_only:
                    log.warning(
                        "config fields changed that take effect only on restart; keeping the running values",
                        fields=list(candidate.restart_only),
                    )
            except ConfigError as exc:
                self._state.reject(str(exc))
                log.error(
                    "config update rejected, keeping the last good config",
                    error=str(exc),
                    version=self._state.loaded.version,
                    path=str(self._path),
                )
                return False
            installed = self._state.accept(candidate.loaded)
            if installed:
                log.info("config update applied", version=candidate.loaded.version, path=str(self._path))
            return installed

    def _read(self, last_digest: str, running: Config) -> _Candidate | None:
        """Worker thread: the file's bytes made into a candidate; None when they are unchanged."""
        try:
            data = read_config_bytes(self._path)
        except ConfigError as exc:
            digest = f"unreadable: {exc}"
            return None if digest == last_digest else _Candidate(digest, error=exc)
        digest = bytes_digest(data)
        if digest == last_digest:
            return None
        if not data.strip():
            # almost always a write caught half-way; "all defaults" would flip every owner
            empty = ConfigError(f"config file {self._path} is empty (write '{{}}' to go back to the defaults)")
            return _Candidate(digest, error=empty)
        try:
            document = parse_config_bytes(data, f"config file {self._path}")
            config, restart_only = keep_restart_only(running, build_config(document, self._overrides))
        except ConfigError as exc:
            return _Candidate(digest, error=exc)
        loaded = LoadedConfig(config=config, version=config_digest(config), source=str(self._path), file_digest=digest)
        return _Candidate(digest, loaded=loaded, restart_only=tuple(restart_only))
