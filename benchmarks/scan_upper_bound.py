"""The scan's upper bound at 10^4, 10^5 and 10^6 Scopes: ``start_scan`` must stay flat.

``start_scan`` reads the binding's highest ``pending_sequence`` while the SQLite write lock (or,
on MySQL, the Lease row lock) is held, so its cost delays every Worker's commit. It used to be a
``MAX`` over the binding (a range scan: 118-203 ms at 10^6 rows); now it is two backwards index
probes. For each size this fills one binding (half its rows dirty, plus a second binding of the
same size so the index has neighbours), then times, in a fenced transaction that is rolled back:

- ``start_scan``: the whole control write as the Supervisor runs it;
- ``upper bound``: ``scans.scan_upper_bound`` alone (the two index probes);
- ``old max``: the former ``SELECT MAX(pending_sequence) WHERE binding_name = ?`` for contrast.

It prints the median of ``--repeat`` runs per size and the ratio of the largest to the smallest
size (flat means close to 1; the old query grows with n).

    .venv/bin/python benchmarks/scan_upper_bound.py [--sizes 10000,100000,1000000]
        [--db-url mysql+pymysql://.../bench]   # default: a temporary SQLite file per size
        [--out NAME]   # default scan_upper_bound_<backend>: .md and .png in benchmarks/results/
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from sqlalchemy import Connection, create_engine, func, insert, select, update
from sqlalchemy.engine import make_url

from apsup.store import migrate, open_backend, scans
from apsup.store.base import SqlBackend
from apsup.store.leases import GLOBAL_KEY
from apsup.store.schema import PENDING_SEQUENCE_COUNTER, counters, intents

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _processes import stop_on_signals
from _report import Plot, context_line, write_results

BINDING = "bench"
NEIGHBOUR = "bench-neighbour"
BATCH = 20_000
WARMUP = 5


class _Rollback(Exception):
    pass


def _fill(backend: SqlBackend, n: int) -> None:
    """``n`` Scopes in each of two bindings, sequences interleaved, every second one dirty."""
    seq = 0
    for start in range(0, n, BATCH):
        rows = []
        for k in range(start, min(n, start + BATCH)):
            for binding in (BINDING, NEIGHBOUR):
                seq += 1
                rows.append(
                    {
                        "binding_name": binding,
                        "scope_id": f"scope-{k:08d}",
                        "pending_sequence": seq,
                        "dirty_generation": k % 2,
                    }
                )
        with backend.transaction() as conn:
            conn.execute(insert(intents), rows)
    with backend.transaction() as conn:
        conn.execute(
            update(counters).where(counters.c.name == PENDING_SEQUENCE_COUNTER).values(value=seq)
        )
    if backend.name == "sqlite":
        with backend.engine.connect() as conn:
            conn.exec_driver_sql("ANALYZE")


def _old_max(conn: Connection) -> None:
    conn.execute(
        select(func.max(intents.c.pending_sequence)).where(intents.c.binding_name == BINDING)
    ).scalar_one()


def _time(backend: SqlBackend, fn: Callable[[Connection], object], repeat: int) -> float:
    term = backend.claim_term(GLOBAL_KEY, "bench", 600)
    assert term is not None
    samples: list[float] = []
    try:
        for _ in range(WARMUP + repeat):
            t0 = time.perf_counter()
            try:
                with backend.fenced(term) as conn:
                    fn(conn)
                    samples.append(time.perf_counter() - t0)
                    raise _Rollback
            except _Rollback:
                pass
    finally:
        backend.release_term(term)
    return statistics.median(samples[WARMUP:])  # the first runs fill statement caches


def _fresh_mysql(url: str, n: int) -> str:
    """A new, empty database ``<name>_<n>`` beside the one named by ``url`` (a bulk DELETE of
    the previous size would exceed OceanBase's statement timeout)."""
    base = make_url(url)
    name = f"{base.database}_{n}"
    admin = create_engine(base.set(database=""))
    try:
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
            conn.exec_driver_sql(f"CREATE DATABASE `{name}`")
    finally:
        admin.dispose()
    return base.set(database=name).render_as_string(hide_password=False)


def _drop_mysql(url: str) -> None:
    u = make_url(url)
    admin = create_engine(u.set(database=""))
    try:
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{u.database}`")
    finally:
        admin.dispose()


def main() -> int:
    stop_on_signals()  # stopped or failed: every child and server it started goes too
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument(
        "--db-url", help="MySQL URL; each size runs in a new database <name>_<n> beside it"
    )
    parser.add_argument(
        "--out", default="", help="results name in benchmarks/results/ (default: by backend)"
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    load_start = os.getloadavg()[0]
    backend_name = "sqlite"
    results: dict[int, tuple[float, float, float]] = {}
    checkpoint = datetime(2026, 1, 1)
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            if args.db_url:
                url = _fresh_mysql(args.db_url, n)
            else:
                url = f"sqlite:///{Path(tmp) / f'scan-{n}.db'}"
            migrate(url)
            backend = open_backend(url)
            try:
                t0 = time.perf_counter()
                _fill(backend, n)
                filled = time.perf_counter() - t0
                start = _time(
                    backend, lambda c: scans.start_scan(c, BINDING, checkpoint), args.repeat
                )
                old = _time(backend, _old_max, args.repeat)
                probe = _time(backend, lambda c: scans.scan_upper_bound(c, BINDING), args.repeat)
                results[n] = (start, old, probe)
                backend_name = backend.name
                with backend.read() as conn:
                    upper = scans.scan_upper_bound(conn, BINDING)
                print(
                    f"{backend.name:6} n={n:>9,}  start_scan {start * 1e3:8.3f} ms   "
                    f"upper bound {probe * 1e3:7.3f} ms   old max {old * 1e3:8.3f} ms   "
                    f"upper={upper}  (filled in {filled:.0f} s)",
                    flush=True,
                )
            finally:
                backend.dispose()
                if args.db_url:
                    _drop_mysql(url)
    small, large = min(results), max(results)
    ratio = [results[large][k] / results[small][k] for k in range(3)]
    print(
        f"ratio n={large:,} / n={small:,}: start_scan {ratio[0]:.2f}   "
        f"upper bound {ratio[2]:.2f}   old max {ratio[1]:.2f}"
    )
    rows: list[list[str | int | float | None]] = [
        [n, results[n][0] * 1e3, results[n][2] * 1e3, results[n][1] * 1e3] for n in sorted(results)
    ]
    path = write_results(
        args.out or f"scan_upper_bound_{backend_name}",
        f"Discovery cost vs backlog size on {backend_name} (`benchmarks/scan_upper_bound.py`)",
        ["Scopes per binding", "start_scan ms", "upper bound ms", "old MAX() ms"],
        rows,
        intro=f"{context_line()} at the end, {load_start:.2f} at the start; median of "
        f"{args.repeat} runs per size after {WARMUP} warm-up runs, in a fenced transaction "
        "that is rolled back; half the Scopes dirty, a neighbour binding of the same size.",
        notes=[
            f"ratio n={large:,} / n={small:,}: start_scan {ratio[0]:.2f}, upper bound "
            f"{ratio[2]:.2f}, old MAX() {ratio[1]:.2f} (flat means close to 1)"
        ],
        plot=Plot(
            x="Scopes per binding",
            y=["start_scan ms", "upper bound ms", "old MAX() ms"],
            xlabel="Scopes per binding (log scale)",
            ylabel="ms per call (log scale)",
            logx=True,
            logy=True,
        ),
    )
    print(f"written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
