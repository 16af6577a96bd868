"""Every relative link in README.md and docs/*.md resolves, and so does every repository path.

Fast and offline: links to other sites are not followed. A link's file must exist; its
``#anchor`` must be a heading of the target document, spelled as GitHub spells heading anchors.
Paths written in backticks (``agent/core/health/monitor.py``, ``scripts/check``, globs such as
``agent/backends/nvml/*.py``) must exist too, so a module that moves cannot leave its old path
behind in the documentation.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"(?<!!)\[(?:[^\]\n]|\][^(\n])*\]\(([^()\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`([^`\n]+)`")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
#: the top-level directories a backticked path may start with
TOP = ("agent/", "tests/", "scripts/", "bench/", "config/", "container/", "proto/", "docs/", ".ci/")


def prose(text: str) -> str:
    """The document without fenced code blocks (their links and paths are examples)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)  # code spans keep their text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links keep their text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(prose(path.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return frozenset(out)


def links(path: Path) -> list[str]:
    return [target for target in LINK.findall(prose(path.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def problems(path: Path) -> list[str]:
    found = []
    for target in links(path):
        file_part, _, anchor = target.partition("#")
        where = (path.parent / file_part).resolve() if file_part else path
        if not where.exists():
            found.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            shown = where.relative_to(ROOT) if where.is_relative_to(ROOT) else where.name
            found.append(f"{target}: no heading #{anchor} in {shown}")
    return found


def repository_paths(path: Path) -> list[str]:
    """Backticked paths into the repository (globs allowed), without placeholders."""
    out = []
    for span in CODE.findall(prose(path.read_text())):
        candidate = span.split()[0] if span.split() else ""
        if candidate.startswith(TOP) and not re.search(r"[<>{}|$]|[A-Z]{4,}", candidate):
            out.append(candidate.rstrip(".,:;"))
    return out


def exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert problems(path) == []


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_exists(path: Path) -> None:
    missing = sorted({p for p in repository_paths(path) if not exists(p)})
    assert missing == []


def test_the_docs_index_lists_every_document() -> None:
    index = ROOT / "docs" / "README.md"
    listed = {target.partition("#")[0] for target in links(index)}
    assert {p.name for p in DOCUMENTS if p.parent.name == "docs" and p != index} <= listed


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Quick start (simulated GPUs, no hardware needed)", "quick-start-simulated-gpus-no-hardware-needed"),
        ("Upgrade, roll back, uninstall", "upgrade-roll-back-uninstall"),
        ("`gpu-agent status`", "gpu-agent-status"),
        ("Figures (2026-12-01)", "figures-2026-12-01"),
        ("Checking on a real GPU: `scripts/device-check.sh`", "checking-on-a-real-gpu-scriptsdevice-checksh"),
    ],
)
def test_slugs_follow_github(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_a_moved_module_is_found() -> None:
    assert not exists("agent/inventory/nvml*.py")
    assert exists("agent/backends/nvml/*.py")


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n\n[ok](#title) [gone](missing.md) [bad](#nowhere) [web](https://example.com)\n")
    assert problems(doc) == ["missing.md: no such file", "#nowhere: no heading #nowhere in doc.md"]
