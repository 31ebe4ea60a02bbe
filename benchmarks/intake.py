"""Intake throughput: how many intents per second the domain side can accept.

Three ways of publishing explicit requests, each on its own family (binding) of a fresh,
migrated database, through ``apsup.connect(url)`` (the engine the docs recommend: on SQLite
``BEGIN IMMEDIATE``, WAL, ``synchronous=FULL``):

- ``request/txn``: ``fam.request(conn, scope)``, one transaction per Scope (one commit each);
- ``request batched``: ``fam.request(conn, scope)`` for every Scope inside one transaction;
- ``request_many``: one ``fam.request_many(conn, scopes)`` inside one transaction.

Each runs twice: on new Scopes (first registration: a row and a pending sequence each) and on
the same Scopes again (existing rows: the generation advances). Rounds are interleaved and the
median round is reported, with the ratios request_many / batched and request_many / per-txn.
The target is >= 20,000 intents/s for ``request_many`` on SQLite in one transaction.

    .venv/bin/python benchmarks/intake.py [--rounds 3] [--per-txn 1000] [--batched 5000]
        [--bulk 20000] [--mysql URL] [--out benchmarks/results/intake.md]

``--mysql`` (default: ``$APSUP_TEST_MYSQL_URL``) adds the same runs on a MySQL/OceanBase server:
a fresh database is created on it for the run and dropped afterwards. The table is printed and
written as Markdown to ``--out``, with a bar plot beside it (same name, ``.png``).
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

import apsup
from apsup.registry import Family, Registry, family
from apsup.store import migrate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _processes import stop_on_signals
from _report import Plot, write_results

MODES = ("request/txn", "request batched", "request_many")


def _noop(scope_id: str, ctx: Any) -> None:
    return None


def _family() -> Family:
    return family(f"intake-{uuid.uuid4().hex[:10]}", registry=Registry())(_noop)


def per_txn(engine: Engine, fam: Family, scopes: list[str]) -> None:
    for scope in scopes:
        with engine.begin() as conn:
            fam.request(conn, scope)


def batched(engine: Engine, fam: Family, scopes: list[str]) -> None:
    with engine.begin() as conn:
        for scope in scopes:
            fam.request(conn, scope)


def bulk(engine: Engine, fam: Family, scopes: list[str]) -> None:
    with engine.begin() as conn:
        fam.request_many(conn, scopes)


RUNNERS: dict[str, Callable[[Engine, Family, list[str]], None]] = {
    "request/txn": per_txn,
    "request batched": batched,
    "request_many": bulk,
}


@contextmanager
def sqlite_url() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="apsup-intake-") as tmp:
        yield f"sqlite:///{Path(tmp) / 'intake.db'}"


@contextmanager
def mysql_url(server: str) -> Iterator[str]:
    """A fresh database on ``server`` for this run, dropped afterwards."""
    name = f"apsup_bench_{secrets.token_hex(4)}"
    admin = create_engine(make_url(server).set(database=None), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE `{name}`"))
        try:
            yield make_url(server).set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as conn:
                conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))
    finally:
        admin.dispose()


def measure(url: str, counts: dict[str, int], rounds: int) -> dict[tuple[str, str], list[float]]:
    """(mode, 'new' | 'existing') -> seconds per round for ``counts[mode]`` intents."""
    migrate(url)
    engine = apsup.connect(url)
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for _ in range(rounds):
            for mode in MODES:  # interleaved: a noisy moment hits every mode alike
                fam = _family()
                scopes = [f"scope-{i:07d}" for i in range(counts[mode])]
                for phase in ("new", "existing"):
                    start = time.perf_counter()
                    RUNNERS[mode](engine, fam, scopes)
                    times.setdefault((mode, phase), []).append(time.perf_counter() - start)
    finally:
        engine.dispose()
    return times


COLUMNS = [
    "backend",
    "mode",
    "Scopes",
    "intents/s (new)",
    "µs/intent (new)",
    "intents/s (existing)",
    "µs/intent (existing)",
]


def table(
    backend: str, counts: dict[str, int], times: dict[tuple[str, str], list[float]]
) -> tuple[list[list[str | int | float | None]], list[str], dict[str, float]]:
    """Rows for the results table, ratio notes, and intents/s by ``"<mode> <phase>"``."""
    rows: list[list[str | int | float | None]] = []
    rates: dict[str, float] = {}
    for mode in MODES:
        cells: list[str | int | float | None] = [backend, mode, counts[mode]]
        for phase in ("new", "existing"):
            seconds = statistics.median(times[(mode, phase)])
            rate = counts[mode] / seconds
            rates[f"{mode} {phase}"] = rate
            cells += [round(rate), seconds / counts[mode] * 1e6]
        rows.append(cells)
    notes = []
    for phase in ("new", "existing"):
        many = rates[f"request_many {phase}"]
        one = rates[f"request/txn {phase}"]
        batch = rates[f"request batched {phase}"]
        notes.append(
            f"{backend}, {phase} Scopes: request_many / batched request = {many / batch:.1f}x, "
            f"request_many / request per transaction = {many / one:.1f}x, "
            f"batched / per transaction = {batch / one:.1f}x"
        )
    return rows, notes, rates


def main(argv: list[str] | None = None) -> int:
    stop_on_signals()  # stopped or failed: every child and server it started goes too
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-txn", type=int, default=1000, help="Scopes, request/txn")
    parser.add_argument("--batched", type=int, default=5000, help="Scopes, request batched")
    parser.add_argument("--bulk", type=int, default=20000, help="Scopes, request_many")
    parser.add_argument(
        "--mysql",
        default=os.environ.get("APSUP_TEST_MYSQL_URL", ""),
        help="MySQL/OceanBase server URL (mysql+pymysql://user@host:port/); empty: SQLite only",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "intake.md"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or min(args.per_txn, args.batched, args.bulk) < 1:
        parser.error("--rounds and the Scope counts must be >= 1")
    counts = {
        "request/txn": args.per_txn,
        "request batched": args.batched,
        "request_many": args.bulk,
    }

    intro = (
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, SQLite "
        f"{sqlite3.sqlite_version}, load average {os.getloadavg()[0]:.1f} at the start; "
        f"median of {args.rounds} interleaved rounds; "
        "engine `apsup.connect(url)` (SQLite: WAL, synchronous=FULL, BEGIN IMMEDIATE)."
    )
    with sqlite_url() as url:
        rows, notes, rates = table("SQLite", counts, measure(url, counts, args.rounds))
    many = rates["request_many new"]
    verdict = (
        f"target: request_many on SQLite in one transaction >= 20,000 intents/s: "
        f"{many:,.0f} (new Scopes), {rates['request_many existing']:,.0f} (existing): "
        f"{'met' if min(many, rates['request_many existing']) >= 20000 else 'NOT met'}"
    )
    if args.mysql:
        with mysql_url(args.mysql) as url:
            more, more_notes, _ = table(
                "MySQL/OceanBase", counts, measure(url, counts, args.rounds)
            )
        rows += more
        notes += more_notes
    path = write_results(
        args.out.stem,
        "Intake throughput (`benchmarks/intake.py`)",
        COLUMNS,
        rows,
        intro=intro,
        notes=[verdict, *notes],
        directory=args.out.parent,
        plot=Plot(
            x="mode",
            y=["intents/s (new)", "intents/s (existing)"],
            series="backend",
            kind="bar",
            logy=True,
            xlabel="how intents are published",
            ylabel="intents/s (log scale)",
        ),
    )
    print(path.read_text())
    print(f"written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
