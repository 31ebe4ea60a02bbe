"""benchmarks/_report.py: every benchmark's Markdown table and PNG plot.

The helper is what turns a run into files a reader can check, so a malformed table or a crash
when matplotlib (an optional extra) is missing would lose a run's figures."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import _report  # noqa: E402

COLUMNS = ["backend", "workers", "invocations/s"]
ROWS: list[list[str | int | float | None]] = [
    ["sqlite", 2, 92.5],
    ["sqlite", 8, 121.25],
    ["mysql", 2, 29.0],
    ["mysql", 8, None],
]


def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def _cells(line: str) -> list[str]:
    assert line.startswith("| ") or line.startswith("|-"), line
    return [c.strip() for c in line.strip("|").split("|")]


def test_markdown_table_is_well_formed(tmp_path: Path) -> None:
    path = _report.write_results(
        "demo", "Demo", COLUMNS, ROWS, notes=["ratio 1.3"], directory=tmp_path
    )
    text = path.read_text()
    assert text.startswith("# Demo\n")
    assert "load average" in text  # the default context line
    lines = _table_lines(text)
    assert len(lines) == 2 + len(ROWS)
    assert _cells(lines[0]) == COLUMNS
    assert _cells(lines[1]) == ["---", "---:", "---:"]  # numbers right-aligned
    for line, row in zip(lines[2:], ROWS, strict=True):
        cells = _cells(line)
        assert len(cells) == len(COLUMNS)
        assert cells[0] == row[0]
    assert _cells(lines[3])[2] == "121"
    assert _cells(lines[5])[2] == "-"  # a missing figure is shown, not dropped
    assert "- ratio 1.3" in text


def test_ragged_row_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expected 3"):
        _report.write_results("bad", "Bad", COLUMNS, [["sqlite", 2]], directory=tmp_path)
    assert not (tmp_path / "bad.md").exists()


def test_pipe_in_a_cell_does_not_break_the_table() -> None:
    table = _report.markdown_table(["a", "b"], [["x|y", 1]])
    assert table.splitlines()[2] == "| x\\|y | 1 |"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="bench extra")
def test_png_is_written_and_small(tmp_path: Path) -> None:
    plot = _report.Plot(
        x="workers", y=["invocations/s"], series="backend", xlabel="Workers", ylabel="per s"
    )
    path = _report.write_results("demo", "Demo", COLUMNS, ROWS, plot=plot, directory=tmp_path)
    png = tmp_path / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 1_000 < png.stat().st_size < 200_000
    assert "![Demo](demo.png)" in path.read_text()


def test_without_matplotlib_markdown_and_one_line_note(tmp_path: Path) -> None:
    """A real interpreter where importing matplotlib fails: no traceback, the table is kept."""
    code = (
        "import sys; sys.modules['matplotlib'] = None; "
        f"sys.path.insert(0, {str(BENCH)!r}); import _report; "
        "_report.write_results('demo', 'Demo', ['x', 'y'], [[1, 2.0], [2, 3.0]], "
        f"plot=_report.Plot(x='x', y=['y'], xlabel='x', ylabel='y'), directory=__import__("
        f"'pathlib').Path({str(tmp_path)!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert "matplotlib is not installed" in done.stderr
    assert (tmp_path / "demo.md").exists() and not (tmp_path / "demo.png").exists()
    assert len(_table_lines((tmp_path / "demo.md").read_text())) == 4
