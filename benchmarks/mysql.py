"""MySQL/OceanBase against SQLite: drain rate, and a request's wake-up from another process.

1. **Drain.** For 2 and 8 Workers, ``--requests`` explicit requests of a no-op family are
   accepted (``request_many``) on a fresh database, then a real host (``build_host``: discovery,
   dispatch, forkserver launch, the Worker's duplicate check and fenced acknowledgment, exit
   classification) runs until every request is durably handled. SQLite and MySQL alternate in
   each of ``--rounds`` rounds (the order flips every round); the MySQL/SQLite drain ratio is
   computed per round and its median reported (target >= 0.8). 1,000 requests by default: a
   300-request drain lasts about half a second, in which single rounds spread 0.51-0.91 on this
   machine and the leader's first dispatch (21-27 ms on MySQL, 12-17 on SQLite, reported on its
   own as "first exit") weighs three times as much. CPU per invocation counts the
   host, the forkserver and every Worker, plus the server when this script started it. Host
   statements per invocation are counted on the host's engines (see ``StatementCounter``).
2. **Wake-up from another process.** A host runs a family with automatic admission disabled.
   Another process (standing in for an ``api`` replica or the user's application) commits
   ``fam.request(conn, ...)`` at irregular moments; the processor records when it starts. The
   latency is processor start minus the end of the publisher's commit: p50/p99 while requests
   keep coming (0.2-1.5 s apart), and separately for requests that follow a long idle gap
   (the worst case of an adaptive poll). Then the host stays idle and the statements it issues
   per second are counted, over the first ``--idle`` seconds and over a later window.

The MySQL server is ``--mysql URL`` (default ``$APSUP_TEST_MYSQL_URL``); without one, a private
seekdb is started like ``./run test`` does (``tests/seekdb_server.py``) and stopped at the end.
A fresh database is created on it for each run and dropped afterwards.

    .venv/bin/python benchmarks/mysql.py [--requests 1000] [--rounds 3] [--mysql URL]
        [--latency-samples 20] [--idle 20] [--out benchmarks/results/mysql.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _processes import stop_on_signals
from dispatch import wake_at_last_exit
from intake import mysql_url

REPO = Path(__file__).resolve().parent.parent
FAMILY_MODULE = "apsup_bench_mysql_family"
MARKS_ENV = "APSUP_BENCH_MARKS"
WORKER_WIRE_ENV = "APSUP_BENCH_WORKER_WIRE"
#: Target for the MySQL/SQLite drain ratio, at 2 and at 8 Workers.
DRAIN_TARGET = 0.8
FAMILY_SOURCE = '''"""Stand-in families for benchmarks/mysql.py."""
import os
import time

from apsup.registry import Registry, family

registry = Registry()

if os.environ.get("APSUP_BENCH_WORKER_WIRE"):
    # Imported by the forkserver: every Worker counts what PyMySQL sends (SQL commands, pings,
    # new connections) and, if it sent anything, appends one line to the file on its way out.
    # A benchmark instrument, not part of apsup. A Worker that sent nothing writes nothing: an
    # append from every Worker cost each MySQL Worker (and only those) ~15 copied pages and
    # three system calls, timed in the drain.
    from pymysql.connections import Connection

    import apsup.workers.invoke as _invoke

    # Counts restart in each new process. Not with an os.register_at_fork hook: a hook from a
    # family module makes the zygote fork with os.fork() instead of its lean fork
    # (apsup.workers.fork), which cost every MySQL Worker of this benchmark ~0.7 ms of CPU.
    _wire, _owner = [0, 0, 0], [0]
    _command, _connect = Connection._execute_command, Connection.connect

    def _mine():
        pid = os.getpid()
        if _owner[0] != pid:
            _owner[0] = pid
            _wire[:] = [0, 0, 0]

    def _counted(self, command, sql):
        _mine()
        if command in (3, 14):  # COM_QUERY, COM_PING
            _wire[0 if command == 3 else 1] += 1
        return _command(self, command, sql)

    def _connecting(self, sock=None):
        _mine()
        _wire[2] += 1
        return _connect(self, sock)

    Connection._execute_command, Connection.connect = _counted, _connecting
    _release = _invoke.release_before_exit

    def _release_and_report():
        _release()
        if _owner[0] != os.getpid():  # nothing counted in this process: nothing sent
            return
        line = " ".join(map(str, _wire)) + "\\n"
        fd = os.open(os.environ["APSUP_BENCH_WORKER_WIRE"], os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    _invoke.release_before_exit = _release_and_report


@family("bench-noop", max_workers=2, timeout=60, registry=registry)
def noop(scope_id, ctx):
    return None


@family("bench-wake", max_workers=4, timeout=60, registry=registry)
def wake(scope_id, ctx):
    started = time.time()
    with open(os.environ["APSUP_BENCH_MARKS"], "a", encoding="utf-8") as fh:
        fh.write(f"{scope_id} {started:.6f}\\n")
'''

PUBLISHER = """
import random, sys, time
sys.path.insert(0, sys.argv[1])
import apsup
from apsup_bench_mysql_family import wake

url, out = sys.argv[2], sys.argv[3]
steady, idle_samples, gap = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
engine = apsup.connect(url)
rng = random.Random(7)
with open(out, "w", encoding="utf-8") as fh:
    plan = [("steady", rng.uniform(0.2, 1.5)) for _ in range(steady)]
    plan += [("idle", gap) for _ in range(idle_samples)]
    for i, (kind, pause) in enumerate(plan):
        time.sleep(pause)
        with engine.begin() as conn:
            wake.request(conn, f"{kind}-{i:04d}")
        fh.write(f"{kind}-{i:04d} {time.time():.6f}\\n")
        fh.flush()
engine.dispose()
"""


# -- helpers ----------------------------------------------------------------------------------
def install_family_module(folder: Path) -> None:
    (folder / f"{FAMILY_MODULE}.py").write_text(FAMILY_SOURCE)
    sys.path.insert(0, str(folder))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p
    )


def family_obj(name: str) -> Any:
    import importlib

    return getattr(importlib.import_module(FAMILY_MODULE), name)


_WIRE = {"query": 0, "ping": 0}


def count_driver_commands() -> None:
    """Count every command PyMySQL sends from this process (the host's connections: Workers
    and publishers are other processes): COM_QUERY (statements, SET, COMMIT, ROLLBACK) and
    COM_PING (the pool's pre-ping). A benchmark instrument, not used by apsup."""
    from pymysql.connections import Connection

    original = Connection._execute_command

    def counted(self: Any, command: int, sql: Any) -> Any:
        if command == 3:  # COM_QUERY
            _WIRE["query"] += 1
        elif command == 14:  # COM_PING
            _WIRE["ping"] += 1
        return original(self, command, sql)

    Connection._execute_command = counted  # type: ignore[method-assign]


class StatementCounter:
    """What the host sends to the database. ``statements``: cursor executes on the host's
    engines (SQLAlchemy's ``before_cursor_execute``). ``commands``: every SQL command, COMMIT
    and ROLLBACK included: on MySQL counted at the driver (``count_driver_commands``), on SQLite
    the statements plus the Connection's COMMIT/ROLLBACK. ``round_trips`` adds MySQL's pings."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._statements = 0
        self._ends = 0
        self._wire0 = dict(_WIRE)

    def attach(self, engine: Any) -> None:
        from sqlalchemy import event

        def on_execute(*args: Any) -> None:
            self._statements += 1

        def on_end(*args: Any) -> None:
            self._ends += 1

        event.listen(engine, "before_cursor_execute", on_execute)
        event.listen(engine, "commit", on_end)
        event.listen(engine, "rollback", on_end)

    def snapshot(self) -> tuple[int, int, int]:
        """(statements, commands, round trips) so far."""
        if self.kind == "mysql":
            queries = _WIRE["query"] - self._wire0["query"]
            pings = _WIRE["ping"] - self._wire0["ping"]
            return self._statements, queries, queries + pings
        total = self._statements + self._ends
        return self._statements, total, total


def host_engines(backend: Any) -> list[Any]:
    engines = [backend.engine]
    read = getattr(backend, "read_engine", None)
    if read is not None and read is not backend.engine:
        engines.append(read)
    return engines


def cpu_seconds(pid: int | None) -> float:
    """utime+stime of process ``pid`` (0 if unknown or gone)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    """This process and its reaped children (the forkserver, which reaps every Worker)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@contextmanager
def database(kind: str, folder: Path, server: str, tag: str) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{folder / f'{tag}.db'}"
    else:
        with mysql_url(server) as url:
            yield url


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


# -- 1. drain ---------------------------------------------------------------------------------
@dataclass
class Drain:
    backend: str
    workers: int
    count: int
    wall: float
    cpu: float  # seconds, all processes (server included when known)
    server_cpu: float
    host_commands: int
    #: What the Workers sent (MySQL only): SQL commands + pings, and new connections, summed
    worker_commands: int = 0
    worker_connects: int = 0
    #: Seconds from the started host to its first classified exit (the leader's start-up).
    first_exit: float = 0.0

    @property
    def rate(self) -> float:
        return self.count / self.wall if self.wall else 0.0

    @property
    def cpu_ms(self) -> float:
        return self.cpu / max(self.count, 1) * 1000

    @property
    def server_ms(self) -> float:
        return self.server_cpu / max(self.count, 1) * 1000

    @property
    def own_ms(self) -> float:
        """apsup's own CPU per task: host, forkserver and Workers, the server left out."""
        return (self.cpu - self.server_cpu) / max(self.count, 1) * 1000

    @property
    def statements_per_inv(self) -> float:
        return self.host_commands / max(self.count, 1)

    @property
    def worker_commands_per_inv(self) -> float:
        return self.worker_commands / max(self.count, 1)


def drain(
    url: str, kind: str, n: int, workers: int, budget: float, server_pid: int | None
) -> Drain:
    from apsup.store import migrate, open_backend
    from apsup.supervisor.launcher import build_host

    migrate(url)
    fam = family_obj("noop").with_overrides(max_workers=workers)
    backend = open_backend(url)
    try:
        with backend.transaction() as conn:
            fam.request_many(conn, [f"scope-{i:06d}" for i in range(n)])
    finally:
        backend.dispose()
    wire = Path(tempfile.mkstemp(prefix="apsup-bench-wire-")[1])
    if kind == "mysql":
        os.environ[WORKER_WIRE_ENV] = str(wire)  # read by the forkserver's family import
    cpu0, srv0 = own_cpu(), cpu_seconds(server_pid)
    bundle = build_host(url, [fam], shutdown_grace=5.0)
    host, sup = bundle.host, bundle.host.supervisors[0]
    wake_at_last_exit(host, fam.name, n)  # the idle tail differed per backend
    counter = StatementCounter(kind)
    for engine in host_engines(host.backend):
        counter.attach(engine)
    try:
        host.start()
        start = time.perf_counter()
        done, first = 0, 0.0
        while done < n:
            if time.perf_counter() - start > budget:
                break
            host.cycle(max_wait=1.0)
            done = sup.completed[fam.name] + sup.failed[fam.name]
            if done and not first:
                first = time.perf_counter() - start
        wall = time.perf_counter() - start
        count, failed = sup.completed[fam.name], sup.failed[fam.name]
    finally:
        host.shutdown()
        bundle.close()
        os.environ.pop(WORKER_WIRE_ENV, None)
    if failed:
        print(f"  warning: {failed} invocation(s) failed", file=sys.stderr)
    srv = cpu_seconds(server_pid) - srv0 if kind == "mysql" else 0.0
    commands = counter.snapshot()[1]
    reports = [[int(x) for x in line.split()] for line in wire.read_text().splitlines()]
    wire.unlink()
    return Drain(
        kind,
        workers,
        count,
        wall,
        own_cpu() - cpu0 + srv,
        srv,
        commands,
        worker_commands=sum(r[0] + r[1] for r in reports),
        worker_connects=sum(r[2] for r in reports),
        first_exit=first,
    )


# -- 2. wake-up latency and idle statements ---------------------------------------------------
@dataclass
class Wake:
    backend: str
    steady: list[float]
    after_idle: list[float]
    #: per idle window: (statements/s, SQL commands/s, round trips/s)
    idle_first: tuple[float, float, float]
    idle_later: tuple[float, float, float]


def wake_latency(
    url: str, kind: str, folder: Path, steady: int, idle_samples: int, gap: float, idle: float
) -> Wake:
    from apsup.store import migrate
    from apsup.supervisor.launcher import build_host

    migrate(url)
    fam = family_obj("wake")
    marks = folder / f"marks-{kind}.txt"
    commits = folder / f"commits-{kind}.txt"
    marks.write_text("")
    os.environ[MARKS_ENV] = str(marks)  # inherited by the forkserver, hence the Workers
    bundle = build_host(url, [fam], shutdown_grace=5.0)
    host = bundle.host
    counter = StatementCounter(kind)
    for engine in host_engines(host.backend):
        counter.attach(engine)
    publisher: subprocess.Popen[bytes] | None = None
    try:
        host.start()
        for _ in range(20):  # let the term settle before the first request
            host.cycle(max_wait=0.1)
        publisher = subprocess.Popen(
            [
                sys.executable,
                "-c",
                PUBLISHER,
                str(folder),
                url,
                str(commits),
                str(steady),
                str(idle_samples),
                str(gap),
            ]
        )
        total = steady + idle_samples
        deadline = time.monotonic() + steady * 1.5 + idle_samples * gap + 60
        while time.monotonic() < deadline:
            host.cycle(max_wait=0.2)
            if publisher.poll() is not None and len(marks.read_text().splitlines()) >= total:
                break
        # Idle: nothing published any more; count what the host itself sends.
        windows: list[tuple[float, float, float]] = []
        for length in (idle, idle):
            before, t0 = counter.snapshot(), time.monotonic()
            while time.monotonic() - t0 < length:
                host.cycle(max_wait=length)
            dt = time.monotonic() - t0
            after = counter.snapshot()
            windows.append(
                (
                    (after[0] - before[0]) / dt,
                    (after[1] - before[1]) / dt,
                    (after[2] - before[2]) / dt,
                )
            )
    finally:
        if publisher is not None and publisher.poll() is None:
            publisher.kill()
            publisher.wait()
        host.shutdown()
        bundle.close()
    started = dict(line.split() for line in marks.read_text().splitlines())
    latencies: dict[str, list[float]] = {"steady": [], "idle": []}
    for line in commits.read_text().splitlines():
        scope, committed = line.split()
        if scope in started:
            latencies[scope.split("-")[0]].append(float(started[scope]) - float(committed))
    return Wake(
        kind,
        latencies["steady"],
        latencies["idle"],
        windows[0],
        windows[1],
    )


# -- main -------------------------------------------------------------------------------------
@contextmanager
def mysql_server(url: str | None) -> Iterator[tuple[str, int | None]]:
    if url:
        yield url, None
        return
    sys.path.insert(0, str(REPO))
    from tests.seekdb_server import SeekdbServer

    server = SeekdbServer().start()
    try:
        assert server.proc is not None
        server.wait_quiet()  # its start-up work is not the first round's
        yield server.admin_url, server.proc.pid
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    stop_on_signals()  # stopped or failed: every child and server it started goes too
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=90.0, help="seconds per drain run")
    parser.add_argument("--mysql", default=os.environ.get("APSUP_TEST_MYSQL_URL", ""))
    parser.add_argument("--server-pid", type=int, default=None, help="count this server's CPU")
    parser.add_argument("--latency-samples", type=int, default=20)
    parser.add_argument("--idle-samples", type=int, default=3)
    parser.add_argument(
        "--idle-gap", type=float, default=12.0, help="seconds before an idle sample"
    )
    parser.add_argument("--idle", type=float, default=20.0, help="seconds per idle window")
    parser.add_argument("--skip-drain", action="store_true")
    parser.add_argument("--skip-wake", action="store_true")
    parser.add_argument(
        "--out",
        default=str(REPO / "benchmarks" / "results" / "mysql.md"),
        help="Markdown result file ('-' or '': none)",
    )
    args = parser.parse_args(argv)

    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    runs: list[Drain] = []
    wakes: list[Wake] = []
    with (
        tempfile.TemporaryDirectory(prefix="apsup-mysql-") as tmp,
        mysql_server(args.mysql) as (server, server_pid),
    ):
        server_pid = server_pid or args.server_pid
        folder = Path(tmp)
        install_family_module(folder)
        count_driver_commands()
        if not args.skip_drain:
            for round_no in range(args.rounds):
                for workers in (2, 8):
                    order = ["sqlite", "mysql"] if (round_no + workers) % 2 else ["mysql", "sqlite"]
                    for kind in order:
                        with database(kind, folder, server, f"d{round_no}-{workers}") as url:
                            run = drain(url, kind, args.requests, workers, args.budget, server_pid)
                        runs.append(run)
                        print(
                            f"round {round_no} {kind:<6} {workers} Workers: {run.rate:6.1f}/s "
                            f"cpu {run.cpu_ms:5.1f} ms/inv (server {run.server_ms:4.1f}) "
                            f"host commands {run.statements_per_inv:.2f} Worker commands "
                            f"{run.worker_commands_per_inv:.2f}",
                            flush=True,
                        )
        if not args.skip_wake:
            for kind in ("mysql", "sqlite"):
                with database(kind, folder, server, f"w-{kind}") as url:
                    wakes.append(
                        wake_latency(
                            url,
                            kind,
                            folder,
                            args.latency_samples,
                            args.idle_samples,
                            args.idle_gap,
                            args.idle,
                        )
                    )
    lines = report(args, runs, wakes, load_start, server_pid is not None)
    text_out = "\n".join(lines) + "\n"
    print()
    print(text_out)
    print(f"total benchmark time: {time.perf_counter() - started:.0f} s")
    if args.out and args.out != "-":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text_out)
        plot_results(Path(args.out), runs)
    return 0


def plot_results(md: Path, runs: list[Drain]) -> None:
    """Median drain rate and CPU per task against Workers, one line per backend."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _report import Plot, attach_plot

    table = []
    for backend in sorted({r.backend for r in runs}):
        for workers in sorted({r.workers for r in runs}):
            same = [r for r in runs if r.backend == backend and r.workers == workers]
            if same:
                rate = statistics.median(r.rate for r in same)
                cpu = statistics.median(r.cpu_ms for r in same)
                table.append([backend, workers, rate, cpu])
    columns = ["backend", "Workers", "tasks/s", "CPU ms/task"]
    plot = Plot(
        x="Workers",
        y=["tasks/s"],
        series="backend",
        xlabel="Workers",
        ylabel="drained tasks/s (median)",
        extra=[
            Plot(
                x="Workers",
                y=["CPU ms/task"],
                series="backend",
                xlabel="Workers",
                ylabel="CPU ms per task (incl. server)",
            )
        ],
    )
    attach_plot(md, "Drain: MySQL/OceanBase against SQLite", columns, table, plot)


def report(
    args: argparse.Namespace, runs: list[Drain], wakes: list[Wake], load: float, server_cpu: bool
) -> list[str]:
    import sqlite3

    lines = [
        "# MySQL/OceanBase against SQLite (`benchmarks/mysql.py`)",
        "",
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, SQLite "
        f"{sqlite3.sqlite_version}, MySQL server: seekdb (OceanBase, MySQL mode) on 127.0.0.1; "
        f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.",
        "",
    ]
    verdicts = []
    if runs:
        lines += [
            f"## Drain: {args.requests} no-op requests, durable completion, "
            f"{args.rounds} interleaved rounds (median)",
            "",
            "| backend | Workers | tasks/s (median) | min-max | first exit ms | CPU ms/task "
            "| of which server | host SQL commands/task | Worker SQL commands/task |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for workers in (2, 8):
            for kind in ("sqlite", "mysql"):
                sel = [r for r in runs if r.backend == kind and r.workers == workers]
                rates = [r.rate for r in sel]
                lines.append(
                    f"| {kind} | {workers} | {statistics.median(rates):.1f} | "
                    f"{min(rates):.1f}-{max(rates):.1f} | "
                    f"{statistics.median(r.first_exit for r in sel) * 1000:.0f} | "
                    f"{statistics.median(r.cpu_ms for r in sel):.1f} | "
                    f"{statistics.median(r.server_ms for r in sel):.1f} | "
                    f"{statistics.median(r.statements_per_inv for r in sel):.2f} | "
                    + (
                        f"{statistics.median(r.worker_commands_per_inv for r in sel):.2f} |"
                        if kind == "mysql"
                        else "- |"
                    )
                )
        lines.append("")
        if server_cpu:
            lines.append(
                "CPU per task: host + forkserver + Workers, plus the seekdb server's CPU for "
                "MySQL (measured over the run; the server also does background work)."
            )
        else:
            lines.append("CPU per task: host + forkserver + Workers (server CPU not measured).")
        lines.append(
            "First exit: from the started host to its first classified exit, inside the drain's "
            "time (the leader's start-up: its first reads and dispatch)."
        )
        lines.append(
            "SQL commands: statements plus COMMIT/ROLLBACK/SET, counted at the driver on MySQL "
            "(pings included), the host's on its engines, each Worker's in the Worker (a new "
            "session's setup included; its handshake is not a command)."
        )
        lines.append("")
        own = []
        for workers in (2, 8):
            ratios, own_ratios = [], []
            for round_no in range(args.rounds):
                pair = {
                    r.backend: r
                    for r in runs[round_no * 4 : round_no * 4 + 4]
                    if r.workers == workers
                }
                if len(pair) == 2:
                    ratios.append(pair["mysql"].rate / pair["sqlite"].rate)
                    own_ratios.append(pair["mysql"].own_ms / pair["sqlite"].own_ms)
            med = statistics.median(ratios)
            ok = "met" if med >= DRAIN_TARGET else "NOT met"
            verdicts.append(
                f"- MySQL/SQLite drain at {workers} Workers: {med:.2f} "
                f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)}); target >= {DRAIN_TARGET}: {ok}"
            )
            by_kind = {
                kind: statistics.median(
                    r.own_ms for r in runs if r.backend == kind and r.workers == workers
                )
                for kind in ("mysql", "sqlite")
            }
            own.append(
                f"- apsup's own CPU per task at {workers} Workers (host, forkserver, Workers; "
                f"the server left out): MySQL {by_kind['mysql']:.2f} ms, SQLite "
                f"{by_kind['sqlite']:.2f} ms, MySQL/SQLite {statistics.median(own_ratios):.2f} "
                f"(rounds: {', '.join(f'{x:.2f}' for x in own_ratios)})"
            )
        verdicts += own
    if wakes:
        lines += [
            "## Wake-up: request committed by another process -> processor start",
            "",
            f"Steady: requests 0.2-1.5 s apart; after idle: each request follows "
            f"{args.idle_gap:.0f} s without any. Idle: what the host sends per second over two "
            f"consecutive {args.idle:.0f} s windows once the publisher stopped: statements "
            "(cursor executes), SQL commands (statements plus COMMIT/ROLLBACK/SET; on MySQL "
            "counted at the driver) and round trips (commands plus the pool's pre-pings). The "
            "host here is `build_host` alone; `apsup run` adds its status reads (the Lease table "
            "every renewal, pending counts every 10 s: about 0.4 statements/s for 2 families).",
            "",
            "| backend | steady p50 ms | steady p99 ms | after idle p50 ms | after idle max ms "
            "| idle 1st window: stmt / cmd / rt per s | idle 2nd window: stmt / cmd / rt per s |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for w in wakes:
            first = " / ".join(f"{x:.2f}" for x in w.idle_first)
            later = " / ".join(f"{x:.2f}" for x in w.idle_later)
            lines.append(
                f"| {w.backend} | {pct(w.steady, 0.5) * 1000:.0f} | "
                f"{pct(w.steady, 0.99) * 1000:.0f} | {pct(w.after_idle, 0.5) * 1000:.0f} | "
                f"{max(w.after_idle, default=float('nan')) * 1000:.0f} | {first} | {later} |"
            )
            if w.backend == "mysql":
                p50 = pct(w.steady, 0.5) * 1000
                settled = w.idle_later[1]
                verdicts.append(
                    f"- MySQL wake-up p50 {p50:.0f} ms (target <= 300 ms: "
                    f"{'met' if p50 <= 300 else 'NOT met'}); idle SQL commands/s once settled "
                    f"{settled:.2f}, statements/s {w.idle_later[0]:.2f} (target <= 2: "
                    f"{'met' if settled <= 2 else 'NOT met'}); first idle window "
                    f"{w.idle_first[1]:.2f} commands/s (fast polling after the last request)"
                )
        lines.append("")
    if verdicts:
        lines += ["## Verdict", "", *verdicts]
    return lines


if __name__ == "__main__":
    random.seed()
    sys.exit(main())
