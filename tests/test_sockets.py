"""What may and may not be removed before listening on a Unix socket path."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from agent.errors import StartupError
from agent.sockets import remove_stale_socket
from tests.test_plugin_fakes import short_tmpdir


def test_nothing_there() -> None:
    with short_tmpdir() as root:
        assert remove_stale_socket(root / "s.sock") is False


def test_a_stale_socket_is_removed() -> None:
    with short_tmpdir() as root:
        path = root / "s.sock"
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))  # bound, never listening: what a crashed run leaves behind
        assert remove_stale_socket(path) is True
        assert not path.exists()


def test_a_socket_someone_serves_on_is_left_alone() -> None:
    with short_tmpdir() as root:
        path = root / "nvidia-gpu.sock"
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))
            s.listen()
            with pytest.raises(StartupError, match="another process is serving on it"):
                remove_stale_socket(path)
            assert path.exists()


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_non_sockets_are_never_removed(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "s.sock"
    if kind == "file":
        path.write_text("someone's data")
    else:
        path.mkdir()
    with pytest.raises(StartupError, match="is in the way"):
        remove_stale_socket(path)
    assert path.exists()
