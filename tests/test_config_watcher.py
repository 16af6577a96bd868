from __future__ import annotations

from pathlib import Path

from agent.core.config.current import ConfigState
from agent.core.config.loader import load_config
from agent.core.config.schema import Owner
from agent.core.config.watcher import ConfigWatcher


def _watcher(path: Path, overrides: dict[str, object] | None = None) -> ConfigWatcher:
    state = ConfigState(load_config(path, overrides))
    return ConfigWatcher(path=path, overrides=overrides or {}, state=state)


async def test_an_override_for_a_gpu_the_node_lacks_is_applied_not_rejected(tmp_path: Path) -> None:
    """It is inert on this node (a GPU off the bus, a pool rule naming another node's GPU)."""
    path = tmp_path / "config.yaml"
    path.write_text("{}\n")
    watcher = _watcher(path)
    path.write_text("ownership: {nodes: [{match: {names: [n]}, gpus: {'9': dra}}]}\n")
    assert await watcher.check()
    assert watcher._state.last_error == ""
    assert not await watcher.check()  # same bytes: not read again


async def test_an_update_during_start_up_is_not_lost(tmp_path: Path) -> None:
    """The watcher's baseline is the bytes the running config came from, not the file later."""
    path = tmp_path / "config.yaml"
    path.write_text("ownership: {default: device-plugin}\n")
    state = ConfigState(load_config(path))
    path.write_text("ownership: {default: dra}\n")  # lands while the agent is still starting
    watcher = ConfigWatcher(path=path, overrides={}, state=state)
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
