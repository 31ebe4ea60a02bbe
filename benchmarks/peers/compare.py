"""apsup beside its peers: the same no-op durable workload through each system, one machine.

For concurrency 2 and 8 and ``--rounds`` interleaved rounds, each system runs (in a fresh
process tree started by ``driver.py``):

- **drain**: N tasks enqueued first, then the workers start; tasks/s over the steady part
  (first to last task completion, so each system's boot is left out alike);
- **stream**: workers started and warmed, then tasks enqueued at a steady rate (``--rate``,
  capped at half the system's drain rate in the same round); latency enqueue -> task done,
  p50 and p99.

CPU per task is the CPU time (user + system) of every process involved over the same window:
the driver, its workers and their children (reaped children included), and, counted apart,
the broker / database server (Redis, PostgreSQL, seekdb when started here). apsup on SQLite has
no server. Every task marks its completion with one appended line (``_marker.py``).

Systems (each skipped with a note when its package or server is missing): apsup on SQLite,
apsup on MySQL (``--mysql URL`` or ``--seekdb``), Celery with a fresh process per task
(``--max-tasks-per-child=1``) and with its reused prefork pool (Redis broker, ``acks_late``),
Dramatiq (Redis), Procrastinate (PostgreSQL), APScheduler (SQLAlchemy job store on SQLite,
process pool). Servers: ``benchmarks/peers/setup.sh``; packages: ``pip install -e '.[bench]'``.

    .venv/bin/python benchmarks/peers/compare.py [--n 300] [--rounds 3] [--rate 50]
        [--systems apsup-sqlite,celery-reused,...] [--seekdb | --mysql URL]

Prints the table and the targets (#15's, and #26's against Celery's fresh process per task),
writes ``benchmarks/results/peers.md`` and ``peers.png``.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import importlib.util
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from _marker import read_marks  # noqa: E402
from _report import Plot, context_line, markdown_table, write_results  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")

SYSTEMS = {
    # name: (python modules needed, server needed, durability note)
    "apsup-sqlite": (
        ["apsup"],
        None,
        "SQLite WAL, synchronous=FULL: fsync per request and per acknowledgment",
    ),
    "apsup-mysql": (
        ["apsup", "pymysql"],
        "mysql",
        "MySQL/OceanBase: each acknowledgment committed by the server",
    ),
    "celery-fresh": (
        ["celery", "redis"],
        "redis",
        "Redis AOF appendfsync everysec (<= ~1 s of acks can be lost); acks_late",
    ),
    "celery-reused": (
        ["celery", "redis"],
        "redis",
        "Redis AOF appendfsync everysec (<= ~1 s of acks can be lost); acks_late",
    ),
    "dramatiq": (
        ["dramatiq", "redis"],
        "redis",
        "Redis AOF appendfsync everysec (<= ~1 s of acks can be lost); ack after run",
    ),
    "procrastinate": (
        ["procrastinate", "psycopg"],
        "postgres",
        "PostgreSQL fsync + synchronous_commit on: each job update flushed",
    ),
    "apscheduler": (
        ["apscheduler", "sqlalchemy"],
        None,
        "job row deleted from the SQLite store when submitted: no completion record",
    ),
}
HOW = {
    "apsup-sqlite": "host + forkserver, fresh process per invocation",
    "apsup-mysql": "host + forkserver, fresh process per invocation",
    "celery-fresh": "prefork, --max-tasks-per-child=1",
    "celery-reused": "prefork pool, processes reused",
    "dramatiq": "C processes x 1 thread",
    "procrastinate": "1 asyncio worker, concurrency C",
    "apscheduler": "BackgroundScheduler + ProcessPoolExecutor(C)",
}


# ---- CPU accounting ------------------------------------------------------------------------


def proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, CPU seconds incl. reaped children) for every process now."""
    out: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                raw = fh.read()
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2 :].split()
        # fields[0] is state (field 3); ppid is field 4, utime..cstime fields 14..17
        ticks = sum(int(fields[k]) for k in (11, 12, 13, 14))
        out[int(entry)] = (int(fields[1]), ticks / CLK_TCK)
    return out


def tree_cpu(table: dict[int, tuple[int, float]], roots: list[int]) -> float:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, todo, seen = 0.0, [r for r in roots if r in table], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += table[pid][1]
        todo.extend(children.get(pid, ()))
    return total


@dataclass
class Samples:
    times: list[float] = field(default_factory=list)
    client: list[float] = field(default_factory=list)
    server: list[float] = field(default_factory=list)

    def take(self, client_roots: list[int], server_roots: list[int]) -> None:
        table = proc_table()
        self.times.append(time.time())
        self.client.append(tree_cpu(table, client_roots))
        self.server.append(tree_cpu(table, server_roots))

    def at(self, series: list[float], t: float) -> float:
        """CPU seconds at time ``t``, linear between the two samples around it."""
        k = bisect.bisect_left(self.times, t)
        if k <= 0:
            return series[0]
        if k >= len(self.times):
            return series[-1]
        t0, t1 = self.times[k - 1], self.times[k]
        f = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
        return series[k - 1] + f * (series[k] - series[k - 1])


# ---- servers ---------------------------------------------------------------------------------


def pid_of(comm: str) -> list[int]:
    """Top processes named ``comm`` (children of one are found through the tree)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                name = Path(f"/proc/{entry}/comm").read_text().strip()
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                parent = Path(f"/proc/{ppid}/comm").read_text().strip() if ppid > 1 else ""
            except (OSError, ValueError, IndexError):
                continue
            if name == comm and parent != comm:
                found.append(int(entry))
    return found


def redis_up(url: str) -> bool:
    try:
        import redis

        return bool(redis.Redis.from_url(url, socket_timeout=2).ping())
    except Exception:
        return False


def postgres_up(url: str) -> bool:
    try:
        import psycopg

        with psycopg.connect(url, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
        return True
    except Exception:
        return False


def server_settings(redis_url: str, pg_url: str, systems: list[str]) -> list[str]:
    """The durability settings the servers actually ran with (the notes above assume
    setup.sh's: Redis appendonly + appendfsync everysec, PostgreSQL defaults)."""
    lines = []
    if any(SYSTEMS[s][1] == "redis" for s in systems):
        try:
            import redis

            r = redis.Redis.from_url(redis_url, socket_timeout=2, decode_responses=True)
            conf = {**r.config_get("appendonly"), **r.config_get("appendfsync")}
            conf.update(r.config_get("save"))
            lines.append("Redis " + ", ".join(f"{k}={v!r}" for k, v in sorted(conf.items())))
        except Exception as exc:
            lines.append(f"Redis settings unreadable ({type(exc).__name__})")
    if any(SYSTEMS[s][1] == "postgres" for s in systems):
        try:
            import psycopg

            with psycopg.connect(pg_url, connect_timeout=3) as conn:
                got = [
                    f"{k}={conn.execute(f'SHOW {k}').fetchone()[0]}"  # type: ignore[index]
                    for k in ("fsync", "synchronous_commit", "wal_sync_method")
                ]
            lines.append("PostgreSQL " + ", ".join(got))
        except Exception as exc:
            lines.append(f"PostgreSQL settings unreadable ({type(exc).__name__})")
    return lines


def fresh_mysql_db(server: str) -> tuple[str, str]:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"apsup_peers_{secrets.token_hex(4)}"
    admin = create_engine(make_url(server).set(database=None), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE `{name}`"))
    admin.dispose()
    return name, make_url(server).set(database=name).render_as_string(hide_password=False)


def drop_mysql_db(server: str, name: str) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    admin = create_engine(make_url(server).set(database=None), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))
    admin.dispose()


# ---- one run ---------------------------------------------------------------------------------


@dataclass
class Result:
    system: str
    mode: str
    concurrency: int
    done: int
    wanted: int
    rate: float  # tasks/s (drain) or offered rate (stream)
    client_ms: float  # CPU ms per task, driver + workers
    server_ms: float | None  # CPU ms per task, broker / database server
    p50_ms: float | None = None
    p99_ms: float | None = None

    @property
    def total_ms(self) -> float:
        return self.client_ms + (self.server_ms or 0.0)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def one_run(
    system: str,
    mode: str,
    c: int,
    n: int,
    rate: float,
    budget: float,
    env: dict[str, str],
    server_roots: list[int],
) -> Result | None:
    with tempfile.TemporaryDirectory(prefix="apsup-peers-run-") as tmp:
        markers, stopfile = f"{tmp}/marks", f"{tmp}/stop"
        run_env = {**env, "PEERS_MARKERS": markers}
        mysql_db = None
        if system == "apsup-mysql":
            mysql_db, run_env["PEERS_MYSQL_DB"] = fresh_mysql_db(env["PEERS_MYSQL"])
        proc = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "driver.py"),
                system,
                mode,
                str(c),
                str(n),
                str(rate),
                stopfile,
            ],
            cwd=HERE,
            env=run_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(f"{tmp}/driver.err", "wb"),  # noqa: SIM115
            start_new_session=True,  # its group is killed with it if this script is stopped
        )
        samples = Samples()
        started = time.time()
        marks: list[tuple[int, float, float]] = []
        try:
            while True:
                samples.take([proc.pid], server_roots)
                marks = [m for m in read_marks(markers) if m[0] >= 0]
                if len(marks) >= n or proc.poll() is not None:
                    break
                if time.time() - started > budget:
                    break
                time.sleep(0.05)
            samples.take([proc.pid], server_roots)
            Path(stopfile).touch()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        finally:
            if proc.poll() is None:  # stopped by a signal or an error: no driver left behind
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if mysql_db:
                drop_mysql_db(env["PEERS_MYSQL"], mysql_db)
        if len(marks) < 2:
            err = Path(f"{tmp}/driver.err").read_text(errors="replace").strip().splitlines()
            print(
                f"  {system} {mode} c={c}: only {len(marks)} task(s) done; driver said: "
                f"{err[-1] if err else '(nothing)'}",
                file=sys.stderr,
            )
            return None
    done_times = sorted(m[2] for m in marks)
    if mode == "drain":
        t0, t1 = done_times[0], done_times[-1]
        counted = len(marks) - 1
        task_rate = counted / (t1 - t0) if t1 > t0 else float("nan")
        lat: list[float] = []
    else:
        t0, t1 = min(m[1] for m in marks), done_times[-1]
        counted = len(marks)
        task_rate = rate
        lat = [(m[2] - m[1]) * 1000 for m in marks]
    client = (samples.at(samples.client, t1) - samples.at(samples.client, t0)) / counted
    server = (samples.at(samples.server, t1) - samples.at(samples.server, t0)) / counted
    return Result(
        system,
        mode,
        c,
        len(marks),
        n,
        task_rate,
        client * 1000,
        server * 1000 if server_roots else None,
        pct(lat, 0.5) if lat else None,
        pct(lat, 0.99) if lat else None,
    )


# ---- report ----------------------------------------------------------------------------------


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    m, lo, hi = med(values), min(values), max(values)
    fmt = (lambda v: f"{v:,.0f}") if m >= 100 else (lambda v: f"{v:.1f}")
    return f"{fmt(m)} ({fmt(lo)}-{fmt(hi)})"


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # the cleanup below runs: driver groups, the private server


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _stop)
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300, help="tasks per drain run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=50.0, help="stream: tasks/s offered")
    parser.add_argument("--stream-seconds", type=float, default=5.0, help="stream: duration")
    parser.add_argument("--budget", type=float, default=45.0, help="seconds per run at most")
    parser.add_argument("--concurrency", default="2,8")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--postgres", default="postgresql://apsup_bench:apsup_bench@127.0.0.1:5432/apsup_bench"
    )
    parser.add_argument("--mysql", default="", help="MySQL/OceanBase server URL for apsup-mysql")
    parser.add_argument("--seekdb", action="store_true", help="start a private seekdb server")
    parser.add_argument("--name", default="peers", help="results file name")
    args = parser.parse_args(argv)
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error("--concurrency: comma-separated integers, e.g. 2,8")
    wanted = [s for s in args.systems.split(",") if s]
    unknown = [s for s in wanted if s not in SYSTEMS]
    if unknown or args.n < 2 or args.rounds < 1:
        parser.error(f"--systems: choose from {', '.join(SYSTEMS)}; --n >= 2, --rounds >= 1")

    seekdb = None
    if args.seekdb and "apsup-mysql" in wanted:
        sys.path.insert(0, str(REPO))
        from tests.seekdb_server import SeekdbServer

        seekdb = SeekdbServer().start()
        seekdb.wait_quiet()  # its start-up work is not the first round's
        args.mysql = seekdb.admin_url
    env = {
        **os.environ,
        "PEERS_REDIS": args.redis,
        "PEERS_PG": args.postgres,
        "PEERS_MYSQL": args.mysql,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    }
    servers = {
        "redis": (redis_up(args.redis), pid_of("redis-server"), "Redis server"),
        "postgres": (postgres_up(args.postgres), pid_of("postgres"), "PostgreSQL (all backends)"),
        "mysql": (
            bool(args.mysql),
            [seekdb.proc.pid] if seekdb and seekdb.proc else [],
            "seekdb server" if seekdb else "not measured (external server)",
        ),
    }
    systems, skipped = [], []
    for name in wanted:
        modules, server, _ = SYSTEMS[name]
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            skipped.append(f"{name}: not installed ({', '.join(missing)}; pip install '.[bench]')")
        elif server and not servers[server][0]:
            skipped.append(f"{name}: no {server} server (benchmarks/peers/setup.sh)")
        else:
            systems.append(name)
    for line in skipped:
        print(f"skipped {line}", file=sys.stderr)
    if not systems:
        print("nothing to run", file=sys.stderr)
        return 2

    load_start = os.getloadavg()
    began = time.time()
    results: dict[tuple[str, str, int], list[Result]] = {}
    try:
        for round_no in range(args.rounds):
            for c in levels:
                for mode in ("drain", "stream"):
                    for name in systems:
                        server = SYSTEMS[name][1]
                        roots = servers[server][1] if server else []
                        rate = args.rate
                        if mode == "stream":
                            drains = results.get((name, "drain", c), [])
                            if not drains:
                                continue
                            rate = min(rate, 0.5 * drains[-1].rate)
                        n = args.n if mode == "drain" else max(2, round(rate * args.stream_seconds))
                        res = one_run(name, mode, c, n, rate, args.budget, env, roots)
                        if res is None:
                            continue
                        results.setdefault((name, mode, c), []).append(res)
                        extra = (
                            f" p50 {res.p50_ms:.0f} ms p99 {res.p99_ms:.0f} ms"
                            if (res.p50_ms is not None and res.p99_ms is not None)
                            else ""
                        )
                        print(
                            f"round {round_no + 1} c={c} {mode:6} {name:14} {res.done}/{res.wanted}"
                            f" {res.rate:8.1f}/s  cpu {res.client_ms:6.2f} ms"
                            f" + server {res.server_ms or 0:5.2f} ms{extra}",
                            flush=True,
                        )
    finally:
        if seekdb is not None:
            seekdb.stop()
    load_end = os.getloadavg()

    columns = [
        "system",
        "conc.",
        "drain tasks/s",
        "CPU ms/task",
        "+ server ms/task",
        "stream rate/s",
        "p50 ms",
        "p99 ms",
        "stream CPU ms/task",
    ]
    rows: list[list[str | int | float | None]] = []
    plot_rows: list[list[str | int | float | None]] = []
    summary: dict[tuple[str, int], dict[str, float]] = {}
    for name in systems:
        for c in levels:
            d = results.get((name, "drain", c), [])
            s = results.get((name, "stream", c), [])
            if not d:
                continue
            incomplete = [r for r in d + s if r.done < r.wanted]
            label = name + (" (some runs incomplete)" if incomplete else "")
            srv = [r.server_ms for r in d if r.server_ms is not None]
            rows.append(
                [
                    label,
                    c,
                    spread([r.rate for r in d]),
                    spread([r.client_ms for r in d]),
                    spread(srv) if srv else "none",
                    med([r.rate for r in s]) if s else None,
                    spread([r.p50_ms for r in s if r.p50_ms is not None]) if s else "-",
                    spread([r.p99_ms for r in s if r.p99_ms is not None]) if s else "-",
                    spread([r.total_ms for r in s]) if s else "-",
                ]
            )
            summary[(name, c)] = {
                "rate": med([r.rate for r in d]),
                "cpu": med([r.total_ms for r in d]),
                "p50": med([r.p50_ms for r in s if r.p50_ms is not None]),
            }
            plot_rows.append(
                [
                    name,
                    f"{c} workers",
                    summary[(name, c)]["rate"],
                    summary[(name, c)]["cpu"],
                    summary[(name, c)]["p50"],
                ]
            )

    ratio_lines, verdicts = [], []
    for base in ("apsup-sqlite", "apsup-mysql"):
        for c in levels:
            if (base, c) not in summary:
                continue
            us = summary[(base, c)]
            parts = []
            for name in systems:
                if name.startswith("apsup") or (name, c) not in summary:
                    continue
                them = summary[(name, c)]
                parts.append(
                    f"{name} drain x{us['rate'] / them['rate']:.2f}, "
                    f"CPU x{us['cpu'] / them['cpu']:.2f}"
                )
            if parts:
                ratio_lines.append(f"{base} / peer at {c}: " + "; ".join(parts))
    for c in levels:
        us = summary.get(("apsup-sqlite", c))
        reused = summary.get(("celery-reused", c))
        fresh = summary.get(("celery-fresh", c))
        if us and reused:
            r = us["cpu"] / reused["cpu"]
            verdicts.append(
                f"target CPU per no-op invocation <= 2x Celery reused pool at {c}: "
                f"{us['cpu']:.1f} ms vs {reused['cpu']:.1f} ms = {r:.2f}x "
                f"{'met' if r <= 2 else 'NOT met'}"
            )
        if us and fresh:
            r = us["rate"] / fresh["rate"]
            verdicts.append(
                f"target drain >= 20x Celery fresh process per task at {c}: "
                f"{us['rate']:.0f}/s vs {fresh['rate']:.1f}/s = {r:.1f}x "
                f"{'met' if r >= 20 else 'NOT met'}"
            )

    # Restated against the floor of a process per invocation (issue #26): apsup's CPU per task
    # over Celery's with a fresh process per task, and the drain ratio to it per round.
    for base in ("apsup-sqlite", "apsup-mysql"):
        for c in levels:
            us, fresh = summary.get((base, c)), summary.get(("celery-fresh", c))
            if not (us and fresh):
                continue
            r = us["cpu"] / fresh["cpu"]
            verdicts.append(
                f"target {base} CPU per task <= 0.15 x Celery fresh process per task at {c}: "
                f"{us['cpu']:.1f} ms vs {fresh['cpu']:.1f} ms = {r:.3f} "
                f"{'met' if r <= 0.15 else 'NOT met'}"
            )
            ours = results.get((base, "drain", c), [])
            theirs = results.get(("celery-fresh", "drain", c), [])
            rounds = [a.rate / b.rate for a, b in zip(ours, theirs, strict=False) if b.rate > 0]
            verdicts.append(
                f"{base} drain / Celery fresh process at {c}, per round: "
                + ", ".join(f"{x:.1f}" for x in rounds)
            )

    settings = server_settings(args.redis, args.postgres, systems)
    durability = [f"{name}: {HOW[name]}; {SYSTEMS[name][2]}" for name in systems]
    durability += [f"settings read from the servers: {line}" for line in settings]
    cpu_scope = (
        "CPU ms/task: driver + workers + their children over the measured window; "
        "+ server: "
        + "; ".join(
            f"{k}: {v[2]}" for k, v in servers.items() if any(SYSTEMS[s][1] == k for s in systems)
        )
    )
    intro = (
        f"{context_line()}; load average {load_start[0]:.2f} at the start, "
        f"{load_end[0]:.2f} at the end; N = {args.n} tasks per drain run, stream "
        f"{args.stream_seconds:.0f} s at min({args.rate:.0f}/s, half the drain rate); "
        f"median (min-max) of {args.rounds} interleaved rounds; "
        f"{time.time() - began:.0f} s in all."
    )
    notes = [*verdicts, *ratio_lines, cpu_scope, *skipped]
    sections = [
        "## How each system ran, and what a completion means",
        "",
        "\n".join(f"- {line}" for line in durability),
    ]
    print()
    print(intro)
    print(markdown_table(columns, rows))
    for line in notes + durability:
        print(f"- {line}")
    path = write_results(
        args.name,
        "apsup and its peers: no-op durable tasks (`benchmarks/peers/compare.py`)",
        columns,
        rows,
        intro=intro,
        notes=notes,
        sections=sections,
        plot_data=(
            ["system", "conc.", "drain tasks/s", "CPU ms/task (all)", "stream p50 ms"],
            plot_rows,
        ),
        plot=Plot(
            x="system",
            y=["drain tasks/s"],
            series="conc.",
            kind="bar",
            logy=True,
            xlabel="",
            ylabel="tasks/s (log)",
            title="drain throughput",
            extra=[
                Plot(
                    x="system",
                    y=["CPU ms/task (all)"],
                    series="conc.",
                    kind="bar",
                    logy=True,
                    xlabel="",
                    ylabel="CPU ms per task (log)",
                    title="CPU per task (all processes)",
                ),
                Plot(
                    x="system",
                    y=["stream p50 ms"],
                    series="conc.",
                    kind="bar",
                    logy=True,
                    xlabel="",
                    ylabel="ms (log)",
                    title="stream latency p50",
                ),
            ],
        ),
    )
    raw = path.with_suffix(".json")  # every run of every round, for re-plotting or checking
    raw.write_text(
        json.dumps([asdict(r) for runs in results.values() for r in runs], indent=1) + "\n"
    )
    print(f"written {path} and {raw.name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
