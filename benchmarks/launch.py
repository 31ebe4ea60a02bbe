"""Worker launch cost: forkserver with preloaded family modules vs ``spawn``.

Measures, for a no-op target in a "family module" that imports sqlalchemy and orjson (what real
families import), launches/s and per-launch latency from ``launch()`` to the *confirmed* exit,
serially and with 2 and 8 Workers in flight. Prints one table and the ratios. Runs in < 60 s.

It also measures the CPU floor of any design with a process per invocation: a bare ``os.fork()``
+ ``os._exit(0)`` + ``waitpid`` of a bare interpreter and of the Worker image (apsup's Worker
wrapper and the database drivers imported), with nothing else done in the child.

    .venv/bin/python benchmarks/launch.py [--quick]

Why it matters (DESIGN.md §6): the launch cost bounds invocations/s per host; spawn re-imports
everything per Worker, the forkserver forks an image that already imported the families.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import multiprocess
from multiprocess.connection import wait

from apsup.workers import WorkerPool
from apsup.workers.child import main as child_main

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _processes import stop_on_signals
from _report import Plot, context_line, write_results

FAMILY_MODULE = "apsup_bench_family"
FAMILY_SOURCE = '''"""Stand-in family module for benchmarks/launch.py."""
import orjson  # noqa: F401
import sqlalchemy  # noqa: F401


def noop(payload: bytes) -> int:
    return 0
'''
TARGET = f"{FAMILY_MODULE}:noop"

#: The smallest CPU cost of one process per invocation: ``os.fork()`` of an image, the child's
#: immediate ``os._exit(0)``, the parent's ``waitpid``; no multiprocess, no database, no Python
#: work in the child. Run in a fresh interpreter per image, so nothing else is mapped.
FORK_FLOOR = """
import os, resource, sys, time
{imports}
def cpu():
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
n = {n}
rss = int(open("/proc/self/statm").read().split()[1]) * 4096
c0, t0 = cpu(), time.perf_counter()
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
print((cpu() - c0) / n, (time.perf_counter() - t0) / n, rss)
"""
#: What a Worker's image holds: apsup's Worker wrapper and both backends' drivers, prepared for
#: forking as the forkserver prepares it (frozen collector, trimmed heap, huge pages).
WORKER_IMAGE = (
    "import apsup.workers.invoke, apsup.store.sqlite, apsup.store.mysql, orjson\n"
    "from apsup.workers.warm import prepare_image\n"
    "prepare_image()"
)


@dataclass
class Result:
    mode: str
    concurrency: int
    launches: int
    wall: float
    latencies: list[float]

    @property
    def per_second(self) -> float:
        return self.launches / self.wall

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.latencies) * 1000

    def pct_ms(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def run_forkserver(pool: WorkerPool, n: int, concurrency: int, budget: float) -> Result:
    """Keep ``concurrency`` Workers in flight through WorkerPool until ``n`` have exited (or
    ``budget`` seconds have passed: a loaded box must not push the run past a minute)."""
    in_flight: dict[str, float] = {}
    latencies: list[float] = []
    launched = 0
    start = time.perf_counter()
    while in_flight or (launched < n and time.perf_counter() - start < budget):
        while (
            len(in_flight) < concurrency and launched < n and time.perf_counter() - start < budget
        ):
            wid = f"b{launched}"
            in_flight[wid] = time.perf_counter()
            pool.launch(wid, TARGET, b"{}", timeout=60)
            launched += 1
        wait(pool.sentinels(), 5.0)
        for ex in pool.poll():
            latencies.append(time.perf_counter() - in_flight.pop(ex.worker_id))
            assert ex.exitcode == 0, ex
    wall = time.perf_counter() - start
    return Result("forkserver+preload", concurrency, len(latencies), wall, latencies)


def run_spawn(n: int, concurrency: int, budget: float) -> Result:
    """Same loop with plain ``multiprocess`` spawn processes running the same child entry."""
    ctx = multiprocess.get_context("spawn")
    in_flight: dict[int, tuple[Any, float]] = {}
    latencies: list[float] = []
    launched = 0
    start = time.perf_counter()
    while in_flight or (launched < n and time.perf_counter() - start < budget):
        while (
            len(in_flight) < concurrency and launched < n and time.perf_counter() - start < budget
        ):
            t0 = time.perf_counter()
            proc = ctx.Process(target=child_main, args=(TARGET, b"{}"))
            proc.start()
            in_flight[proc.sentinel] = (proc, t0)
            launched += 1
        for sentinel in wait(list(in_flight), 5.0):
            proc, t0 = in_flight.pop(sentinel)
            proc.join()
            latencies.append(time.perf_counter() - t0)
            assert proc.exitcode == 0, proc.exitcode
            proc.close()
    return Result("spawn", concurrency, len(latencies), time.perf_counter() - start, latencies)


def fork_floor(imports: str, n: int) -> tuple[float, float, float]:
    """(CPU ms, wall ms, MB resident) per bare fork + exit + reap of an image ``imports`` built."""
    import subprocess

    code = FORK_FLOOR.format(imports=imports, n=n)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    cpu, wall, rss = (float(x) for x in out.stdout.split())
    return cpu * 1000, wall * 1000, rss / 1e6


def main() -> None:
    stop_on_signals()  # stopped or failed: every child and server it started goes too
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer launches (smoke run)")
    args = parser.parse_args()
    n_fork, n_spawn = (40, 6) if args.quick else (300, 24)
    fork_budget, spawn_budget = 4.0, 5.0  # seconds per run: under 60 s even on a loaded box
    levels = (1, 2, 8)

    tmp = tempfile.mkdtemp(prefix="apsup-bench-")
    Path(tmp, f"{FAMILY_MODULE}.py").write_text(FAMILY_SOURCE)
    # The forkserver and spawned children find the family module via PYTHONPATH / sys.path.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, tmp)

    load_before = f"{os.getloadavg()[0]:.2f}"  # other work on the box skews every figure
    results: list[Result] = []
    t_start = time.perf_counter()
    t = time.perf_counter()
    with WorkerPool([FAMILY_MODULE]) as pool:
        startup = time.perf_counter() - t
        run_forkserver(pool, 20, 1, fork_budget)  # warm caches
        for level in levels:
            results.append(run_forkserver(pool, n_fork, level, fork_budget))
    run_spawn(2, 1, spawn_budget)  # warm the page cache for a fair first spawn
    for level in levels:
        results.append(run_spawn(n_spawn, level, spawn_budget))

    n_floor = 300 if args.quick else 2000
    floors = [
        ("bare interpreter", *fork_floor("", n_floor)),
        ("Worker image", *fork_floor(WORKER_IMAGE, n_floor)),
    ]

    header = f"{'mode':<20}{'conc':>5}{'launches':>10}{'launches/s':>12}"
    header += f"{'mean ms':>10}{'p50 ms':>9}{'p95 ms':>9}"
    print(f"load average (1 min) before: {load_before}, after: {os.getloadavg()[0]:.2f}")
    print(
        f"Worker launch -> confirmed exit, no-op target importing sqlalchemy+orjson "
        f"({os.cpu_count()} CPUs, pool startup incl. preload probe {startup * 1000:.0f} ms)"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.mode:<20}{r.concurrency:>5}{r.launches:>10}{r.per_second:>12.1f}"
            f"{r.mean_ms:>10.2f}{r.pct_ms(0.5):>9.2f}{r.pct_ms(0.95):>9.2f}"
        )
    print()
    for level in levels:
        fs = next(r for r in results if r.mode == "forkserver+preload" and r.concurrency == level)
        sp = next(r for r in results if r.mode == "spawn" and r.concurrency == level)
        print(
            f"conc {level}: forkserver+preload is {fs.per_second / sp.per_second:.1f}x the "
            f"launches/s of spawn, {sp.mean_ms / fs.mean_ms:.1f}x lower mean latency"
        )
    print()
    print("CPU floor of a process per invocation (fork + os._exit + waitpid, nothing else):")
    for name, cpu_ms, wall_ms, rss_mb in floors:
        print(f"  {name:<18} {rss_mb:5.0f} MB resident: {cpu_ms:.2f} ms CPU, {wall_ms:.2f} ms wall")
    total = time.perf_counter() - t_start
    print(f"total benchmark time {total:.1f} s")
    notes = [
        f"CPU floor of a process per invocation, {name} ({rss_mb:.0f} MB resident): "
        f"{cpu_ms:.2f} ms CPU and {wall_ms:.2f} ms wall per fork + `os._exit` + `waitpid`, with "
        "no multiprocess, no database and no Python work in the child"
        for name, cpu_ms, wall_ms, rss_mb in floors
    ]
    for level in levels:
        fs = next(r for r in results if r.mode == "forkserver+preload" and r.concurrency == level)
        sp = next(r for r in results if r.mode == "spawn" and r.concurrency == level)
        notes.append(
            f"{level} in flight: forkserver+preload {fs.per_second / sp.per_second:.1f}x the "
            f"launches/s of spawn, {sp.mean_ms / fs.mean_ms:.1f}x lower mean latency"
        )
    path = write_results(
        "launch",
        "Worker launch cost: forkserver + preload vs spawn (`benchmarks/launch.py`)",
        ["mode", "in flight", "launches", "launches/s", "mean ms", "p50 ms", "p95 ms"],
        [
            [
                r.mode,
                r.concurrency,
                r.launches,
                r.per_second,
                r.mean_ms,
                r.pct_ms(0.5),
                r.pct_ms(0.95),
            ]
            for r in results
        ],
        intro=f"{context_line()} at the end, {load_before} before; launch -> confirmed "
        "exit of a no-op target importing sqlalchemy and orjson; pool startup incl. preload "
        f"probe {startup * 1000:.0f} ms; {total:.0f} s in all.",
        notes=notes,
        plot=Plot(
            x="in flight",
            y=["launches/s"],
            series="mode",
            xlabel="Workers in flight",
            ylabel="launches/s",
            logy=True,
            extra=[
                Plot(
                    x="in flight",
                    y=["p50 ms"],
                    series="mode",
                    xlabel="Workers in flight",
                    ylabel="launch -> exit p50 (ms)",
                    logy=True,
                )
            ],
        ),
    )
    print(f"written to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
