"""One measured run of one system, in its own process (compare.py measures this process tree).

    python driver.py SYSTEM MODE CONCURRENCY N RATE STOPFILE

``drain``: enqueue N no-op tasks, then start the workers; ``stream``: start the workers, wait
until one warm-up task per slot has run, then enqueue N tasks at RATE per second. Either way the
driver then waits for STOPFILE (compare.py creates it once every task has marked its completion,
or its time budget ran out), stops the workers gracefully and exits. Task ids < 0 are warm-ups.
Each system's queue/tables are emptied before its run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC
from pathlib import Path

from _marker import read_marks

HERE = Path(__file__).resolve().parent
Send = Callable[[int, float], None]


def pace(send: Send, n: int, rate: float) -> None:
    """Send task ids 0..n-1 at ``rate`` per second on a fixed schedule (no drift)."""
    t0 = time.time()
    for i in range(n):
        delay = t0 + i / rate - time.time()
        if delay > 0:
            time.sleep(delay)
        send(i, time.time())


def warm_up(send: Send, concurrency: int, budget: float = 60.0) -> None:
    for k in range(1, concurrency + 1):
        send(-k, time.time())
    deadline = time.time() + budget
    while time.time() < deadline:
        if sum(1 for i, _, _ in read_marks(os.environ["PEERS_MARKERS"]) if i < 0) >= concurrency:
            return
        time.sleep(0.05)
    raise SystemExit("warm-up tasks did not complete")


def wait_stop(stopfile: str) -> None:
    while not os.path.exists(stopfile):
        time.sleep(0.05)


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_system(
    mode: str,
    n: int,
    rate: float,
    stopfile: str,
    send: Send,
    start_workers: Callable[[], subprocess.Popen[bytes]],
    concurrency: int,
) -> None:
    if mode == "drain":
        for i in range(n):
            send(i, time.time())
        proc = start_workers()
    else:
        proc = start_workers()
        warm_up(send, concurrency)
        pace(send, n, rate)
    wait_stop(stopfile)
    stop_process(proc)


def child(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, *args], cwd=HERE, stdin=subprocess.DEVNULL)


def flush_redis() -> None:
    import redis

    redis.Redis.from_url(os.environ["PEERS_REDIS"]).flushdb()


def celery(mode: str, c: int, n: int, rate: float, stopfile: str, fresh: bool) -> None:
    from peer_celery import noop

    flush_redis()
    extra = ["--max-tasks-per-child=1"] if fresh else []
    args = ["-m", "celery", "-A", "peer_celery", "worker", "-P", "prefork", "-c", str(c)]
    args += ["-Q", "bench", "--without-gossip", "--without-mingle", "--without-heartbeat"]
    args += ["-l", "WARNING", *extra]
    run_system(
        mode, n, rate, stopfile, lambda i, t: noop.apply_async((i, t)), lambda: child(*args), c
    )


def dramatiq(mode: str, c: int, n: int, rate: float, stopfile: str) -> None:
    from peer_dramatiq import noop

    flush_redis()
    args = ["-m", "dramatiq", "peer_dramatiq", "--processes", str(c), "--threads", "1"]
    args += ["-Q", "bench"]
    run_system(mode, n, rate, stopfile, lambda i, t: noop.send(i, t), lambda: child(*args), c)


WORKER = "import sys, peer_procrastinate as p; p.work(int(sys.argv[1]), sys.argv[2] == 'stream')"


def procrastinate(mode: str, c: int, n: int, rate: float, stopfile: str) -> None:
    import psycopg
    from peer_procrastinate import app, noop

    with app.open():
        with psycopg.connect(os.environ["PEERS_PG"], autocommit=True) as conn:
            exists = conn.execute("SELECT to_regclass('procrastinate_jobs')").fetchone()
            if exists is None or exists[0] is None:
                app.schema_manager.apply_schema()
            conn.execute("TRUNCATE procrastinate_jobs RESTART IDENTITY CASCADE")
        run_system(
            mode,
            n,
            rate,
            stopfile,
            lambda i, t: noop.defer(task_id=i, enqueued=t),
            lambda: child("-c", WORKER, str(c), mode),
            c,
        )


def apscheduler(mode: str, c: int, n: int, rate: float, stopfile: str, folder: str) -> None:
    from datetime import datetime

    from apscheduler.executors.pool import ProcessPoolExecutor
    from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
    from apscheduler.schedulers.background import BackgroundScheduler
    from peer_apscheduler import noop

    scheduler = BackgroundScheduler(
        jobstores={"default": SQLAlchemyJobStore(url=f"sqlite:///{folder}/jobs.db")},
        executors={"default": ProcessPoolExecutor(c)},
        job_defaults={"misfire_grace_time": None, "coalesce": False},
        timezone=UTC,
    )

    def send(i: int, t: float) -> None:
        scheduler.add_job(noop, "date", run_date=datetime.now(UTC), args=(i, t), id=str(i))

    if mode == "drain":
        scheduler.start(paused=True)
        for i in range(n):
            send(i, time.time())
        scheduler.resume()
    else:
        scheduler.start()
        warm_up(send, c)
        pace(send, n, rate)
    wait_stop(stopfile)
    scheduler.shutdown(wait=True)


# Imported, not run as __main__: the Worker resolves the family by its module's name.
HOST = "import sys, peer_apsup; peer_apsup.main(sys.argv[1], int(sys.argv[2]))"


def apsup(mode: str, c: int, n: int, rate: float, stopfile: str, url: str) -> None:
    from peer_apsup import noop

    import apsup as apsup_pkg
    from apsup.store import migrate

    migrate(url)
    engine = apsup_pkg.connect(url)

    def send(i: int, t: float) -> None:
        with engine.begin() as conn:
            noop.request(conn, f"{i}:{t:.6f}")

    try:
        if mode == "drain":
            with engine.begin() as conn:  # one transaction, like the peers' untimed enqueue
                noop.request_many(conn, [f"{i}:{time.time():.6f}" for i in range(n)])
            proc = child("-c", HOST, url, str(c))
        else:
            proc = child("-c", HOST, url, str(c))
            warm_up(send, c)
            pace(send, n, rate)
        wait_stop(stopfile)
        stop_process(proc)
    finally:
        engine.dispose()


def main() -> None:
    system, mode, c_s, n_s, rate_s, stopfile = sys.argv[1:7]
    c, n, rate = int(c_s), int(n_s), float(rate_s)
    with tempfile.TemporaryDirectory(prefix="apsup-peers-") as folder:
        if system == "celery-fresh":
            celery(mode, c, n, rate, stopfile, fresh=True)
        elif system == "celery-reused":
            celery(mode, c, n, rate, stopfile, fresh=False)
        elif system == "dramatiq":
            dramatiq(mode, c, n, rate, stopfile)
        elif system == "procrastinate":
            procrastinate(mode, c, n, rate, stopfile)
        elif system == "apscheduler":
            apscheduler(mode, c, n, rate, stopfile, folder)
        elif system == "apsup-sqlite":
            apsup(mode, c, n, rate, stopfile, f"sqlite:///{folder}/apsup.db")
        elif system == "apsup-mysql":
            apsup(mode, c, n, rate, stopfile, os.environ["PEERS_MYSQL_DB"])
        else:
            raise SystemExit(f"unknown system {system!r}")


if __name__ == "__main__":
    main()
