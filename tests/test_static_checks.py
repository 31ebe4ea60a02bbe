"""The code base stays ruff-formatted, ruff-clean and mypy-clean (typed public API)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        ["mypy", "apsup"],
    ],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_static_check_passes(command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_mypy_covers_workers_and_families(tmp_path: Path) -> None:
    """workers/ and families/ install as apsup.workers / apsup.families: type-check them in the
    namespace they are imported from (a tree of links laid out like the installed package)."""
    pkg = tmp_path / "apsup"
    pkg.mkdir()
    for entry in (ROOT / "apsup").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    (pkg / "workers").symlink_to(ROOT / "workers")
    (pkg / "families").symlink_to(ROOT / "families")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "apsup"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    checked = int(re.search(r"in (\d+) source files", result.stdout).group(1))  # type: ignore[union-attr]
    assert checked > len(list((ROOT / "apsup").rglob("*.py")))  # workers/families were included
