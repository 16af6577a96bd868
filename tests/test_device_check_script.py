"""The Python that scripts/device-check.sh runs on a GPU machine still compiles and imports.

The script is run rarely (a GPU is lent for minutes), so an import left behind by a move of
modules would only show there. This checks every here-document of Python in the script: it
compiles, and every ``from agent... import ...`` in it names a module and names that exist.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "device-check.sh"
HEREDOC = re.compile(r"<<'EOF'\n(.*?)^EOF$", re.S | re.M)


def python_blocks() -> list[str]:
    return HEREDOC.findall(SCRIPT.read_text())


def test_the_script_has_python_blocks() -> None:
    assert len(python_blocks()) >= 3


@pytest.mark.parametrize("block", python_blocks(), ids=lambda block: block.splitlines()[0][:40])
def test_each_python_block_compiles_and_its_agent_imports_resolve(block: str) -> None:
    tree = ast.parse(block, filename=str(SCRIPT))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "agent":
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), (
                    f"{SCRIPT.name}: from {node.module} import {alias.name}"
                )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "agent":
                    importlib.import_module(alias.name)
