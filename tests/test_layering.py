"""The layering rules of docs/architecture.md, checked against every import in agent/.

The table in the document is the only statement of the rules: this test parses it, finds the
room of every module and of everything it imports (function-level and TYPE_CHECKING imports
too), and fails on any arrow the table does not allow, naming the file and the import.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
START, END = "<!-- layering rules: read by tests/test_layering.py -->", "<!-- end of layering rules -->"


def read_rules(text: str) -> dict[str, set[str]]:
    """Room -> the rooms it may import, from the table between the two markers."""
    body = text.split(START, 1)[1].split(END, 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("| `")]
    rules: dict[str, set[str]] = {}
    for row in rows:
        room_cell, allowed_cell = (cell.strip() for cell in row.strip("|").split("|"))
        rules[room_cell.strip("`")] = set(re.findall(r"`([^`]+)`", allowed_cell))
    core = {room for room in rules if room.startswith("core.")}
    for allowed in rules.values():
        if "core.*" in allowed:
            allowed.discard("core.*")
            allowed |= core
    return rules


def room_of(module: str) -> str | None:
    """The room of a dotted module name inside the package, or None outside it."""
    parts = module.split(".")
    if parts[0] != "agent":
        return None
    if len(parts) == 1 or parts[1] in ("__init__", "__main__"):
        return "agent"
    if parts[1] == "core" and len(parts) > 2:
        return f"core.{parts[2]}"
    return parts[1]


def module_name(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every absolute import in the file."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            # ``from agent.cdi import spec``: the names may be modules of another room
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def sources() -> list[Path]:
    return sorted(p for p in (ROOT / "agent").rglob("*.py") if "_proto" not in p.relative_to(ROOT).parts[1:2])


def violations(rules: dict[str, set[str]]) -> list[str]:
    found = []
    for path in sources():
        source = room_of(module_name(path))
        assert source is not None
        if source not in rules:
            found.append(f"{path.relative_to(ROOT)}: room {source!r} is not in the table")
            continue
        for line, target in imports(path):
            room = room_of(target)
            if room in (None, "agent", source) or room in rules[source]:
                continue
            if room not in rules:
                # ``from agent.core import x`` names a module of a room; the module form is checked
                continue
            found.append(f"{path.relative_to(ROOT)}:{line}: {source} imports {target} ({room})")
    return sorted(set(found))


def test_every_import_in_the_package_follows_the_table() -> None:
    assert violations(read_rules(DOC.read_text())) == []


def test_the_table_names_every_room_and_runs_one_way() -> None:
    rules = read_rules(DOC.read_text())
    rooms = {room_of(module_name(p)) for p in sources()}
    assert rooms - set(rules) == set(), "rooms missing from docs/architecture.md"
    assert set().union(*rules.values()) - set(rules) == set(), "the table allows rooms that do not exist"
    # no circle: some room can always be taken away that nothing left imports
    left = dict(rules)
    while left:
        leaf = next((room for room, allowed in left.items() if not (allowed & set(left)) - {room}), None)
        assert leaf is not None, f"the rules go round in a circle among {sorted(left)}"
        del left[leaf]


def test_the_checker_sees_an_arrow_the_table_forbids(tmp_path: Path) -> None:
    rules = read_rules(DOC.read_text())
    rules["base"] = set()
    rules["observe"] = rules["observe"] - {"kube"}
    assert any("observe imports agent.kube" in v for v in violations(rules))


@pytest.mark.parametrize(
    ("module", "room"),
    [
        ("agent", "agent"),
        ("agent.__main__", "agent"),
        ("agent.core.ownership.handover", "core.ownership"),
        ("agent.core.mechanism", "core.mechanism"),
        ("agent.dra.claims.driver", "dra"),
        ("structlog", None),
    ],
)
def test_rooms_of_modules(module: str, room: str | None) -> None:
    assert room_of(module) == room
