"""Wake-up: a request committed by another process -> its processor starts.

For SQLite and for MySQL/OceanBase, a leader runs as a real ``apsup run`` process (HTTP
listener, membership, everything a deployment has) and a separate publisher process (standing
in for the application, or an ``api`` replica) commits ``family.request(conn, ...)`` at
irregular moments: ``--samples`` requests 0.2-1.5 s apart, then ``--idle-samples`` that each
follow ``--gap`` seconds of silence (the worst case of an adaptive poll). The processor records
when it starts; the latency is that minus the end of the publisher's commit (same machine, same
clock). SQLite wakes its host through the commit hook's datagram; MySQL nudges the leaders
named by membership (``apsup.supervisor.nudge``), with the poll as the safety net.

Prints, on lines of their own::

    SQLite wake-up p50 X ms p99 Y ms
    MySQL wake-up p50 X ms p99 Y ms

The MySQL server is ``--mysql URL`` (default ``$APSUP_TEST_MYSQL_URL``), else a private seekdb.

    .venv/bin/python benchmarks/wakeup.py [--samples 40] [--idle-samples 4] [--gap 8]
        [--mysql URL] [--out benchmarks/results/wakeup.md | -]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _processes import PhaseFailed, child_group, progress, stop_on_signals
from _report import context_line, write_results
from intake import mysql_url
from mysql import mysql_server

from apsup.config import Settings
from apsup.store import migrate

REPO = Path(__file__).resolve().parent.parent
MODULE = "apsup_bench_wakeup_family"
SOURCE = '''"""The family of benchmarks/wakeup.py: it records when it starts."""
import os
import time

from apsup.registry import family


@family("bench-wakeup", max_workers=4, timeout=60)
def bench_wakeup(scope_id, ctx):
    started = time.time()
    with open(os.environ["APSUP_BENCH_MARKS"], "a", encoding="utf-8") as fh:
        fh.write(f"{scope_id} {started:.6f}\\n")
'''
PUBLISHER = """
import random, sys, time
sys.path.insert(0, sys.argv[1])
import apsup
from apsup_bench_wakeup_family import bench_wakeup

url, out = sys.argv[2], sys.argv[3]
samples, idle_samples, gap = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
name = sys.argv[7]
engine = apsup.connect(url)
rng = random.Random(11)
plan = [rng.uniform(0.2, 1.5) for _ in range(samples)] + [gap] * idle_samples
with open(out, "w", encoding="utf-8") as fh:
    for i, pause in enumerate(plan):
        if i:
            time.sleep(pause)
        with engine.begin() as conn:
            bench_wakeup.request(conn, f"{name}{i:04d}")
        fh.write(f"{name}{i:04d} {time.time():.6f}\\n")
        fh.flush()
engine.dispose()
"""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def _marked(marks: Path) -> dict[str, float]:
    return {
        scope: float(at)
        for scope, at in (line.split() for line in marks.read_text().splitlines() if line)
    }


def _wait_for(what: str, done: Callable[[], bool], bound: float, leader: Any, log: Path) -> None:
    """Wait up to ``bound`` seconds for ``done``; fail with one line if the leader died."""
    deadline = time.monotonic() + bound
    while not done():
        if leader.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:]
            raise PhaseFailed(f"{what}: the leader exited ({leader.returncode}) {' '.join(tail)}")
        if time.monotonic() >= deadline:
            raise PhaseFailed(f"{what}: not done within {bound:g} s (leader log: {log})")
        time.sleep(0.05)


def measure(url: str, folder: Path, kind: str, args: argparse.Namespace) -> list[float]:
    """Latencies (s) of every request, with a fresh leader on ``url``."""
    migrate(url)
    marks, commits = folder / f"marks-{kind}.txt", folder / f"commits-{kind}.txt"
    marks.write_text("")
    prefix = Settings.default_prefix()
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefix)}
    env.update(
        {
            prefix + "DATABASE_URL": url,
            prefix + "HTTP_PORT": "0",
            prefix + "LOG_LEVEL": "WARNING",
            "APSUP_BENCH_MARKS": str(marks),
            "PYTHONPATH": os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH")) if p),
        }
    )
    log_path = folder / f"leader-{kind}.log"
    publish = [sys.executable, "-c", PUBLISHER, str(folder), url, str(commits)]
    with (
        open(log_path, "wb") as log,
        child_group(
            [sys.executable, "-m", "apsup.cli", "run", "--app", MODULE],
            env=env,
            cwd=folder,
            stdout=log,
            stderr=subprocess.STDOUT,
        ) as leader,
    ):
        progress(f"{kind}: leader started (pid {leader.pid}); waiting for it to dispatch")
        # Ready means dispatching: one warm-up request, published by another process, ran.
        with child_group([*publish, "1", "0", "0", "warm"], env=env) as warm:
            try:
                warm.wait(args.ready_bound)
            except subprocess.TimeoutExpired:
                raise PhaseFailed(f"{kind} warm-up request not committed in time") from None
        _wait_for(
            f"{kind} host ready",
            lambda: "warm0000" in _marked(marks),
            args.ready_bound,
            leader,
            log_path,
        )
        marks.write_text("")
        total = args.samples + args.idle_samples
        plan = args.samples * 1.5 + args.idle_samples * args.gap
        progress(f"{kind}: host ready; publishing {total} requests (at most {plan:.0f} s)")
        sample = [*publish, str(args.samples), str(args.idle_samples), str(args.gap), "s"]
        with child_group(sample, env=env) as publisher:
            try:
                publisher.wait(plan + 60)
            except subprocess.TimeoutExpired:
                raise PhaseFailed(f"{kind} publisher: not done within {plan + 60:.0f} s") from None
            if publisher.returncode != 0:
                raise PhaseFailed(f"{kind} publisher exited {publisher.returncode}")
        _wait_for(
            f"{kind} samples ({total} requests started)",
            lambda: len(_marked(marks)) >= total,
            args.sample_bound,
            leader,
            log_path,
        )
        progress(f"{kind}: {total} samples taken")
    started = _marked(marks)
    out = []
    for line in commits.read_text().splitlines():
        scope, committed = line.split()
        if scope in started:
            out.append(started[scope] - float(committed))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--idle-samples", type=int, default=4)
    parser.add_argument("--gap", type=float, default=8.0)
    parser.add_argument(
        "--ready-bound", type=float, default=60.0, help="seconds for a leader to dispatch"
    )
    parser.add_argument(
        "--sample-bound", type=float, default=30.0, help="seconds for the last sample to start"
    )
    parser.add_argument("--mysql", default=os.environ.get("APSUP_TEST_MYSQL_URL"))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "wakeup.md"))
    args = parser.parse_args(argv)
    stop_on_signals()
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="apsup-wakeup-") as tmp:
        folder = Path(tmp)
        (folder / f"{MODULE}.py").write_text(SOURCE)
        results["SQLite"] = measure(f"sqlite:///{folder / 'wake.db'}", folder, "sqlite", args)
        progress("mysql: " + ("using --mysql" if args.mysql else "starting a private seekdb"))
        with mysql_server(args.mysql) as (server, _), mysql_url(server) as url:
            results["MySQL"] = measure(url, folder, "mysql", args)
    rows, lines = [], []
    for name, values in results.items():
        p50, p99 = pct(values, 0.5) * 1000, pct(values, 0.99) * 1000
        line = f"{name} wake-up p50 {p50:.0f} ms p99 {p99:.0f} ms"
        lines.append(line)
        print(line)
        rows.append([name, len(values), round(p50, 1), round(p99, 1), round(max(values) * 1000, 1)])
    if args.out not in ("", "-"):
        write_results(
            Path(args.out).stem,
            "Wake-up: request committed by another process -> processor start",
            ["backend", "requests", "p50 ms", "p99 ms", "max ms"],
            rows,
            notes=[
                *lines,
                f"{args.samples} requests 0.2-1.5 s apart, then {args.idle_samples} after "
                f"{args.gap:g} s of silence each; leader: `apsup run`, publisher: another "
                "process on the same machine.",
                "Targets: SQLite p50 <= 15 ms and p99 <= 50 ms; MySQL p50 <= 50 ms.",
            ],
            intro=context_line(),
            directory=Path(args.out).parent,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
