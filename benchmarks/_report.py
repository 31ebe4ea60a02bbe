"""Shared output of the benchmarks: a Markdown table and a PNG plot in ``benchmarks/results/``.

Every benchmark prints its figures and also leaves them where a reader of the repository sees
them: ``<name>.md`` (a heading, a context line with CPUs and load average, the table, notes)
and ``<name>.png`` (one small plot of the same rows). matplotlib is optional (the ``bench``
extra): without it the Markdown is still written and one line says the plot was skipped.

    from _report import Plot, write_results
    write_results(
        "dispatch", "Dispatch throughput", ["workers", "invocations/s"], rows,
        plot=Plot(x="workers", y=["invocations/s"], xlabel="Workers", ylabel="invocations/s"),
        notes=["Supervisor / floor at 2 Workers: 1.25 (target <= 1.3)"],
    )
"""

from __future__ import annotations

import os
import platform
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"

Cell = str | int | float | None


@dataclass
class Plot:
    """What to draw from the rows: ``x`` column against each ``y`` column, one line (or bar
    group) per ``series`` value when given. Columns are named by their header text."""

    x: str
    y: Sequence[str]
    xlabel: str
    ylabel: str
    series: str | None = None
    kind: str = "line"  # "line" or "bar"
    logx: bool = False
    logy: bool = False
    title: str | None = None
    extra: list[Plot] = field(default_factory=list)  # further panels, side by side


def context_line() -> str:
    """CPUs, Python and the 1-minute load average now: timings on a shared box need it."""
    load = os.getloadavg()[0]
    return f"{os.cpu_count()} CPUs, Python {platform.python_version()}, load average {load:.2f}"


def format_cell(value: Cell) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Cell]]) -> str:
    """A GitHub Markdown table; numeric columns are right-aligned."""
    if not columns:
        raise ValueError("a table needs at least one column")
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells, expected {len(columns)}")
    numeric = [
        bool(rows) and all(isinstance(r[i], int | float) or r[i] is None for r in rows)
        for i in range(len(columns))
    ]
    head = "| " + " | ".join(format_cell(c) for c in columns) + " |"
    rule = "|" + "|".join("---:" if n else "---" for n in numeric) + "|"
    body = ["| " + " | ".join(format_cell(c) for c in row) + " |" for row in rows]
    return "\n".join([head, rule, *body])


def _number(value: Cell) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    return None


def _draw(ax, plot: Plot, columns: Sequence[str], rows: Sequence[Sequence[Cell]]) -> None:  # type: ignore[no-untyped-def]
    xi = list(columns).index(plot.x)
    si = list(columns).index(plot.series) if plot.series else None
    groups: dict[str, list[Sequence[Cell]]] = {}
    for row in rows:
        groups.setdefault(str(row[si]) if si is not None else "", []).append(row)
    if plot.kind == "bar":
        xs = list(dict.fromkeys(str(r[xi]) for r in rows))
        labels = [(g, y) for g in groups for y in plot.y]
        width = 0.8 / max(len(labels), 1)
        for k, (g, y) in enumerate(labels):
            yi = list(columns).index(y)
            by_x = {str(r[xi]): _number(r[yi]) for r in groups[g]}
            heights = [by_x.get(x) or 0.0 for x in xs]
            pos = [i + (k - (len(labels) - 1) / 2) * width for i in range(len(xs))]
            name = " ".join(p for p in (g, y if len(plot.y) > 1 else "") if p)
            ax.bar(pos, heights, width, label=name or None)
        ax.set_xticks(range(len(xs)))
        ax.set_xticklabels(xs, rotation=30 if max(map(len, xs), default=0) > 8 else 0, ha="right")
    else:
        for g, grows in groups.items():
            for y in plot.y:
                yi = list(columns).index(y)
                pts = [(_number(r[xi]), _number(r[yi])) for r in grows]
                pts = [(a, b) for a, b in pts if a is not None and b is not None]
                name = " ".join(p for p in (g, y if len(plot.y) > 1 else "") if p)
                ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=name or None)
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}")
    if plot.logx:
        ax.set_xscale("log")
    if plot.logy:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)  # 20, not 2x10^1
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(plot.xlabel)
    ax.set_ylabel(plot.ylabel)
    if plot.title:
        ax.set_title(plot.title, fontsize=10)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def write_plot(
    path: Path, title: str, columns: Sequence[str], rows: Sequence[Sequence[Cell]], plot: Plot
) -> bool:
    """Draw ``plot`` into ``path``; False (and one line on stderr) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            f"note: matplotlib is not installed, {path.name} not drawn (pip install -e '.[bench]')",
            file=sys.stderr,
        )
        return False
    panels = [plot, *plot.extra]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.6), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        _draw(ax, panel, columns, rows)
    # A title wider than the figure is cut off: wrap it to the figure's width.
    fig.suptitle(textwrap.fill(title, width=int(10 * 5.2 * len(panels))), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def write_results(
    name: str,
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[Cell]],
    *,
    plot: Plot | None = None,
    notes: Sequence[str] = (),
    intro: str | None = None,
    sections: Sequence[str] = (),
    directory: Path | None = None,
    plot_data: tuple[Sequence[str], Sequence[Sequence[Cell]]] | None = None,
) -> Path:
    """Write ``<name>.md`` (and ``<name>.png`` when ``plot`` is given); returns the .md path.

    ``intro`` defaults to :func:`context_line`; ``notes`` become a bullet list under the
    table; ``sections`` are further Markdown blocks appended as they are. ``plot_data``
    (columns, rows) feeds the plot instead of the table when the table's cells are text."""
    folder = directory or RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    md = folder / f"{name}.md"
    parts = [f"# {title}", "", intro or context_line(), "", markdown_table(columns, rows), ""]
    if notes:
        parts += [f"- {n}" for n in notes] + [""]
    png = folder / f"{name}.png"
    pcols, prows = plot_data or (columns, rows)
    if plot is not None and write_plot(png, title, pcols, prows, plot):
        parts += [f"![{title}]({png.name})", ""]
    for block in sections:
        parts += [block.rstrip(), ""]
    md.write_text("\n".join(parts))
    return md


def attach_plot(
    md: Path, title: str, columns: Sequence[str], rows: Sequence[Sequence[Cell]], plot: Plot
) -> None:
    """Draw ``<md stem>.png`` beside a Markdown file a script wrote itself, and link it there.

    For benchmarks whose Markdown is richer than one table (dispatch.py, mysql.py)."""
    png = md.with_suffix(".png")
    if write_plot(png, title, columns, rows, plot):
        md.write_text(md.read_text().rstrip("\n") + f"\n\n![{title}]({png.name})\n")
