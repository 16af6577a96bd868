from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent.config.loader import LoadedConfig, build_config, load_config
from agent.config.schema import Owner
from agent.config.state import ConfigState
from agent.config.watcher import ConfigWatcher, keep_restart_only
from agent.errors import ConfigError


def _watcher(path: Path, validate: object = None, overrides: dict[str, object] | None = None) -> ConfigWatcher:
    state = ConfigState(load_config(path, overrides))

    def accept_all(loaded: LoadedConfig) -> None:
        return None

    return ConfigWatcher(path=path, overrides=overrides or {}, state=state, validate=validate or accept_all)  # type: ignore[arg-type]


async def test_check_applies_changes_and_rejects_bad_ones(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("ownership: {default: device-plugin}\n")
    watcher = _watcher(path)
    state = watcher._state
    assert not await watcher.check()  # nothing changed

    path.write_text("ownership: {default: dra}\n")
    assert await watcher.check()
    assert state.config.ownership.default is Owner.DRA
    good_version = state.loaded.version

    path.write_text("ownership: {default: maybe}\n")
    assert not await watcher.check()
    assert "ownership.default" in state.last_error
    assert state.loaded.version == good_version and state.rejections == 1

    path.unlink()
    assert not await watcher.check()
    assert "cannot read config file" in state.last_error
    assert state.config.ownership.default is Owner.DRA

    path.write_text("ownership: {default: none}\n")
    assert await watcher.check()
    assert state.last_error == "" and state.reloads == 2


async def test_validator_can_reject(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("{}\n")

    def refuse(loaded: LoadedConfig) -> None:
        raise ConfigError("ownership.nodes[0].gpus['9']: no GPU with that UUID or index on node 'n'")

    watcher = _watcher(path, refuse)
    path.write_text("ownership: {default: dra}\n")
    assert not await watcher.check()
    assert "gpus['9']" in watcher._state.last_error


async def test_flags_keep_winning_after_reload(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("log_level: info\n")
    watcher = _watcher(path, overrides={"log_level": "debug"})
    path.write_text("log_level: warning\nownership: {default: none}\n")
    assert await watcher.check()
    assert watcher._state.config.log_level == "debug"


def test_restart_only_fields_keep_running_values() -> None:
    old = build_config({"debug_addr": "127.0.0.1:9477", "paths": {"cdi_root": "/a"}})
    new = build_config({"debug_addr": "127.0.0.1:9500", "paths": {"cdi_root": "/b"}, "ownership": {"default": "dra"}})
    merged, changed = keep_restart_only(old, new)
    assert changed == ["debug_addr", "paths"]
    assert merged.debug_addr == "127.0.0.1:9477" and str(merged.paths.cdi_root) == "/a"
    assert merged.ownership.default is Owner.DRA


async def test_run_notices_a_rewrite(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("ownership: {default: device-plugin}\n")
    watcher = _watcher(path)
    with watcher._state.changes.subscribe() as changes:
        task = asyncio.create_task(watcher.run())
        try:
            # the watcher is armed once it runs; keep rewriting until an event arrives
            async def rewrite_until_seen() -> LoadedConfig:
                n = 0
                while True:
                    n += 1
                    path.write_text(f"ownership: {{default: dra}}\n# {n}\n")
                    try:
                        return await asyncio.wait_for(changes.get(), timeout=0.5)
                    except TimeoutError:
                        continue

            loaded = await asyncio.wait_for(rewrite_until_seen(), timeout=5)
            assert loaded.config.ownership.default is Owner.DRA
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


async def test_a_rejected_file_is_tried_again_when_the_node_changes(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("{}\n")
    gpus_on_node = {"0"}

    def fits(loaded: LoadedConfig) -> None:
        for rule in loaded.config.ownership.nodes:
            missing = set(rule.gpus) - gpus_on_node
            if missing:
                raise ConfigError(f"no GPU {sorted(missing)} on this node")

    watcher = _watcher(path, fits)
    assert not watcher.retry()  # nothing was rejected: nothing to do
    path.write_text("ownership: {nodes: [{match: {names: [n]}, gpus: {'1': dra}}]}\n")
    assert not await watcher.check()
    assert "no GPU ['1']" in watcher._state.last_error
    assert not await watcher.check()  # same bytes: not read again on its own
    gpus_on_node.add("1")  # the GPU is back (an inventory refresh found it)
    assert watcher.retry()
    assert await watcher.check()
    assert watcher._state.last_error == ""
    assert not watcher.retry()


async def test_an_update_during_start_up_is_not_lost(tmp_path: Path) -> None:
    """The watcher's baseline is the bytes the running config came from, not the file later."""
    path = tmp_path / "config.yaml"
    path.write_text("ownership: {default: device-plugin}\n")
    state = ConfigState(load_config(path))
    path.write_text("ownership: {default: dra}\n")  # lands while the agent is still starting
    watcher = ConfigWatcher(path=path, overrides={}, state=state, validate=lambda loaded: None)
    assert await watcher.check()
    assert state.config.ownership.default is Owner.DRA


async def test_a_file_that_is_not_utf8_is_rejected_not_fatal(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("{}\n")
    watcher = _watcher(path)
    path.write_bytes(b"ownership: {default: \xff\xfe}\n")
    assert not await watcher.check()
    assert "is not UTF-8 text" in watcher._state.last_error


async def test_an_emptied_file_is_not_taken_for_all_defaults(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("ownership: {default: dra}\n")
    watcher = _watcher(path)
    path.write_text("")  # e.g. `cat > config.yaml` caught between truncate and write
    assert not await watcher.check()
    assert "is empty" in watcher._state.last_error
    assert watcher._state.config.ownership.default is Owner.DRA
    path.write_text("{}\n")  # the explicit way back to the defaults
    assert await watcher.check()
    assert watcher._state.config.ownership.default is Owner.DEVICE_PLUGIN
