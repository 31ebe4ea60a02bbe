"""docs/first-family.md is executed, not just shown: in an empty folder, in order, every block
with ``file=PATH`` is written to PATH and every ``sh`` block runs in bash (``-euo pipefail``),
with this environment's ``apsup``, ``alembic`` and ``python`` first on PATH."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "first-family.md"
BLOCK = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```$", re.M | re.S)
PREFIXES = ("POWERCONTEXT_SERVER_RUNTIME_", "APSUP_")

pytestmark = pytest.mark.timeout(300)


def blocks() -> list[tuple[str, str | None, str]]:
    out = []
    for lang, info, body in BLOCK.findall(DOC.read_text()):
        match = re.search(r"file=(\S+)", info)
        out.append((lang, match.group(1) if match else None, body))
    return out


def test_every_block_is_a_file_or_a_command() -> None:
    found = blocks()
    assert sum(1 for lang, _, _ in found if lang == "sh") >= 3
    assert all(path or lang == "sh" for lang, path, _ in found), found


def test_the_walkthrough_runs_as_written(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIXES)}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    for n, (_, path, body) in enumerate(blocks(), 1):
        if path is not None:
            target = tmp_path / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(body)
            continue
        out = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", body],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        log = tmp_path / "var" / "host.log"
        host = log.read_text()[-3000:] if log.exists() else ""
        assert out.returncode == 0, (
            f"block {n}:\n{body}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}\n{host}"
        )
    shown = subprocess.run(
        [sys.executable, "show_receipts.py"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert shown.stdout.strip() == "Receipt for order 1: green tea", shown
