"""The committed generated protobuf code is exactly what scripts/gen-proto.sh produces.

Regenerates into a temporary root and compares every file byte for byte, so a proto edited
without regenerating (or generated code edited by hand) fails here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TREES = ("agent/_proto", "tests/_grpcio")


def _files(root: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for tree in TREES:
        for path in sorted((root / tree).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                out[str(path.relative_to(root))] = path.read_bytes()
    return out


def test_committed_generated_code_matches_the_script(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "gen-proto.sh"), str(tmp_path)],
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    fresh, committed = _files(tmp_path), _files(REPO)
    assert sorted(fresh) == sorted(committed), "generated files differ in name: run scripts/gen-proto.sh"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"committed generated code is stale, run scripts/gen-proto.sh: {stale}"
