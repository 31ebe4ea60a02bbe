"""Dedicated mode, scaled out: throughput of 1 replica against 3 on one MySQL-compatible server.

Four families whose processor sleeps ``--sleep`` seconds (default 0.2, standing in for a call
to another service) with ``--workers`` Workers each run in ``dedicated`` mode. For R = 1 and
R = 3 background replicas (real ``apsup run`` processes, each a launcher with one Supervisor
process per family), on a fresh database:

1. start the replicas and wait until the placement settled: every replica keeps its membership
   rows and leads floor(4/R)..ceil(4/R) families;
2. accept ``--requests`` requests per family (one transaction per family) and time until every
   one is durably handled.

The family budget (``max_workers``) is the same in both runs: scale-out moves families, it never
adds Workers. What 3 replicas add is CPU: each replica is pinned to its own CPU when the machine
has enough (``--pin``, default when there are at least R + 1 CPUs: one per replica and one for
the server), standing in for one machine per replica; with fewer CPUs the replicas share them
and the ratio says so. The result line is

    3 replicas / 1 replica throughput X (N CPUs[, replicas pinned to one CPU each])

The server is ``--mysql URL`` (default ``$APSUP_TEST_MYSQL_URL``), else a private seekdb like
``./run test`` starts.

    .venv/bin/python benchmarks/scaleout.py [--requests 200] [--workers 16] [--sleep 0.2]
        [--mysql URL] [--pin | --no-pin] [--out benchmarks/results/scaleout.md | -]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import func, select, text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _processes import stop_on_signals
from _report import context_line, write_results
from intake import mysql_url
from mysql import mysql_server

from apsup.config import Settings
from apsup.store import migrate, open_backend
from apsup.store.schema import intents, leases, replicas

REPO = Path(__file__).resolve().parent.parent
PREFIX = Settings.default_prefix()
FAMILIES = ["scale-w", "scale-x", "scale-y", "scale-z"]
MODULE = "apsup_bench_scaleout_families"
SOURCE = '''"""Stand-in families for benchmarks/scaleout.py (a sleep; the wrapper acknowledges)."""
import os
import time

from apsup.registry import family

SLEEP = float(os.environ.get("APSUP_BENCH_SLEEP", "0.2"))
WORKERS = int(os.environ.get("APSUP_BENCH_WORKERS", "16"))


@family("scale-w", max_workers=WORKERS, timeout=60)
def scale_w(scope_id, ctx):
    time.sleep(SLEEP)


@family("scale-x", max_workers=WORKERS, timeout=60)
def scale_x(scope_id, ctx):
    time.sleep(SLEEP)


@family("scale-y", max_workers=WORKERS, timeout=60)
def scale_y(scope_id, ctx):
    time.sleep(SLEEP)


@family("scale-z", max_workers=WORKERS, timeout=60)
def scale_z(scope_id, ctx):
    time.sleep(SLEEP)
'''


def _env(url: str, folder: Path, replica: str, args: argparse.Namespace) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    env.update(
        {
            PREFIX + "DATABASE_URL": url,
            PREFIX + "ARTIFACT_PROCESSING_SUPERVISOR_MODE": "dedicated",
            PREFIX + "ARTIFACT_PROCESSING_ROLE": "background",
            PREFIX + "LEASE_SECONDS": "6",
            PREFIX + "RENEW_SECONDS": "2",
            PREFIX + "POLL_SECONDS": "0.5",
            PREFIX + "HTTP_PORT": "0",
            PREFIX + "REPLICA_ID": replica,
            PREFIX + "LOG_LEVEL": "WARNING",
            "APSUP_BENCH_SLEEP": str(args.sleep),
            "APSUP_BENCH_WORKERS": str(args.workers),
            "PYTHONPATH": os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH")) if p),
        }
    )
    return env


@contextlib.contextmanager
def replicas_running(
    url: str, folder: Path, count: int, args: argparse.Namespace, pin: bool
) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = []
    cpus = sorted(os.sched_getaffinity(0))
    try:
        for i in range(count):
            cpu = cpus[(i + 1) % len(cpus)]  # CPU 0 left to the server and this script

            def pinned(cpu: int = cpu) -> None:
                os.sched_setaffinity(0, {cpu})

            log = open(folder / f"replica-{count}-{i}.log", "wb")  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "apsup.cli", "run", "--app", MODULE],
                    env=_env(url, folder, f"bench-{i}", args),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=pinned if pin else None,
                )
            )
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def settled(backend: object, count: int) -> bool:
    """Every replica keeps its rows and the live Leases are spread floor..ceil."""
    with backend.engine.connect() as conn:  # type: ignore[attr-defined]
        members = conn.execute(
            select(replicas.c.replica_id, func.count()).group_by(replicas.c.replica_id)
        ).all()
        held = conn.execute(
            select(replicas.c.replica_id, func.count())
            .select_from(leases.join(replicas, replicas.c.holder_id == leases.c.holder_id))
            .where(leases.c.expires_at > func.utc_timestamp(6))
            .group_by(replicas.c.replica_id)
        ).all()
        conn.rollback()
    if len([r for r, n in members if n >= len(FAMILIES)]) < count:
        return False
    loads = sorted(n for _, n in held)
    low, high = len(FAMILIES) // count, -(-len(FAMILIES) // count)
    return (
        sum(loads) == len(FAMILIES) and len(loads) == count and low <= loads[0] <= loads[-1] <= high
    )


def run_once(server: str, folder: Path, count: int, args: argparse.Namespace, pin: bool) -> float:
    """Invocations/s with ``count`` replicas on a fresh database."""
    sys.path.insert(0, str(folder))
    import importlib

    module = importlib.import_module(MODULE)
    with mysql_url(server) as url:
        migrate(url)
        backend = open_backend(url)
        try:
            with replicas_running(url, folder, count, args, pin) as procs:
                deadline = time.monotonic() + 180
                while not settled(backend, count):
                    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                        logs = "\n".join(
                            p.read_text(errors="replace")[-2000:]
                            for p in sorted(folder.glob(f"replica-{count}-*.log"))
                        )
                        raise SystemExit(f"{count} replica(s) did not settle:\n{logs}")
                    time.sleep(0.2)
                time.sleep(1.0)  # the last handover's successor established its term
                start = time.perf_counter()
                for name in FAMILIES:
                    with backend.transaction() as conn:
                        getattr(module, name.replace("-", "_")).request_many(
                            conn, [f"scope-{i:05d}" for i in range(args.requests)]
                        )
                total = args.requests * len(FAMILIES)
                while True:
                    with backend.engine.connect() as conn:
                        left = conn.execute(
                            select(func.count()).where(
                                intents.c.requested_generation > intents.c.handled_generation
                            )
                        ).scalar_one()
                        conn.rollback()
                    if not left:
                        break
                    if time.perf_counter() - start > args.budget:
                        raise SystemExit(f"{left} of {total} not handled in {args.budget}s")
                    time.sleep(0.05)
                elapsed = time.perf_counter() - start
        finally:
            with contextlib.suppress(Exception), backend.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            backend.dispose()
    return total / elapsed


def main(argv: list[str] | None = None) -> int:
    stop_on_signals()  # stopped or failed: every child and server it started goes too
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="per family")
    parser.add_argument("--workers", type=int, default=16, help="max_workers per family")
    parser.add_argument("--sleep", type=float, default=0.2)
    parser.add_argument("--budget", type=float, default=300.0)
    parser.add_argument("--mysql", default=os.environ.get("APSUP_TEST_MYSQL_URL"))
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "scaleout.md"))
    args = parser.parse_args(argv)
    cpus = len(os.sched_getaffinity(0))
    pin = cpus >= 4 if args.pin is None else args.pin
    rates: dict[int, float] = {}
    with (
        tempfile.TemporaryDirectory(prefix="apsup-scaleout-") as tmp,
        mysql_server(args.mysql) as (server, _),
    ):
        folder = Path(tmp)
        (folder / f"{MODULE}.py").write_text(SOURCE)
        for count in (1, 3):
            rates[count] = run_once(server, folder, count, args, pin)
            print(f"{count} replica(s): {rates[count]:.1f} invocations/s", flush=True)
    ratio = rates[3] / rates[1]
    if not pin:
        where = f"{cpus} CPUs, shared by the replicas"
    elif cpus >= 4:
        where = f"{cpus} CPUs, each replica pinned to a CPU of its own"
    else:
        where = f"{cpus} CPUs, replicas pinned round-robin to {cpus - 1 or 1}+ CPUs"

    line = f"3 replicas / 1 replica throughput {ratio:.2f} ({where})"
    print(line)
    if args.out not in ("", "-"):
        write_results(
            Path(args.out).stem,
            "Dedicated scale-out: 1 replica against 3",
            ["replicas", "invocations/s"],
            [[1, round(rates[1], 1)], [3, round(rates[3], 1)]],
            notes=[
                line,
                f"4 families x {args.workers} Workers, a {args.sleep:g} s sleep per invocation, "
                f"{args.requests} requests per family; the same family budget in both runs.",
                "Target >= 2.5 where each replica has a CPU of its own (pinned, >= 4 CPUs); "
                "with fewer CPUs the replicas share them and the ratio measures only the "
                "placement's overhead.",
            ],
            intro=context_line(),
            directory=Path(args.out).parent,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
