"""The committed generated protobuf code is exactly what scripts/gen-proto.sh produces.

Regenerates into a temporary root and compares every file byte for byte, so a proto edited
without regenerating (or generated code edited by hand) fails here. The script runs only with
the generator versions pyproject.toml pins, so the comparison does not depend on what the
newest grpcio-tools release happens to be.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
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


def test_the_grpcio_stubs_were_made_by_the_pinned_grpcio_tools() -> None:
    """A pin moved without regenerating (or the other way round) is named here, not as a diff."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    (pin,) = [req.split("==", 1)[1] for req in extra if req.startswith("grpcio-tools==")]
    stubs = sorted((REPO / "tests" / "_grpcio").glob("*_pb2_grpc.py"))
    assert stubs
    for stub in stubs:
        match = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'$", stub.read_text(), re.M)
        made_by = match.group(1) if match else None
        assert made_by == pin, f"{stub.name}: made by grpcio-tools {made_by}, pinned {pin}"
