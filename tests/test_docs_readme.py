"""README.md and docs/ stand alone for a reader of the repository: no path outside it, no RFC
section numbers or pull-request numbers, working relative links; the quick start is exactly
``./run demo`` and ``./run test``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_pages_reference_nothing_outside_the_repository() -> None:
    for page in PAGES:
        text = page.read_text()
        for pattern in (r"\.\./shared", r"RFC\s*§", r"§\s*\d", r"PR #\d+", r"/work/"):
            assert not re.search(pattern, text), (page.name, pattern)


def test_relative_links_resolve() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            path = (page.parent / target).resolve()
            assert path.exists(), (page.name, target)


def test_quick_start_is_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None
    commands = [ln.split("#", 1)[0].strip() for ln in block.group(1).splitlines()]
    assert [c for c in commands if c] == ["./run demo", "./run test"]
