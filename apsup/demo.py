"""``apsup demo``: a self-contained workload on the embedded SQLite default, with a live view.

Four families show the contract at a glance: independent intervals and budgets, a slow family
that fills its own capacity without stopping the others, a flaky one whose failing Scopes sit in
backoff while their siblings complete, and one with automatic admission disabled that runs only
on explicit requests. Producers write domain input (``mark_dirty``/``request``) from a thread, as
an application would, and notify the host over the local control channel.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from apsup.context import ExecutionContext
from apsup.registry import Family, Registry, family
from apsup.store import migrate
from apsup.supervisor.control import notify
from apsup.supervisor.host import Host
from apsup.supervisor.launcher import build_host

registry = Registry()


def _work(ctx: ExecutionContext, seconds: float) -> None:
    with ctx.fenced() as conn:
        snapshot = ctx.dirty_generation(conn)
    time.sleep(seconds)  # compute outside any transaction
    with ctx.fenced() as conn:
        ctx.mark_clean(conn, snapshot)
        ctx.acknowledge(conn)


@family("demo-fast", interval=2, max_workers=3, timeout=30, registry=registry)
def fast(scope_id: str, ctx: ExecutionContext) -> None:
    _work(ctx, random.uniform(0.05, 0.3))


@family("demo-slow", interval=3, max_workers=1, timeout=30, registry=registry)
def slow(scope_id: str, ctx: ExecutionContext) -> None:
    _work(ctx, random.uniform(1.0, 2.0))


@family("demo-flaky", interval=2, max_workers=2, timeout=30, registry=registry)
def flaky(scope_id: str, ctx: ExecutionContext) -> None:
    if scope_id.endswith("-3"):
        raise RuntimeError("demo failure: this Scope always fails and backs off")
    _work(ctx, random.uniform(0.05, 0.2))


@family("demo-requests", max_workers=2, timeout=30, registry=registry)
def on_request(scope_id: str, ctx: ExecutionContext) -> None:
    _work(ctx, random.uniform(0.1, 0.4))


def _produce(url: str, families: list[Family], stop: threading.Event) -> None:
    from apsup.store import open_backend

    backend = open_backend(url)
    rng = random.Random(7)
    try:
        while not stop.wait(0.15):
            fam = rng.choice(families)
            scope = f"{fam.name.split('-', 1)[1]}-{rng.randint(1, 8)}"
            with backend.transaction() as conn:
                if fam.name == "demo-requests":
                    fam.request(conn, scope)
                else:
                    fam.mark_dirty(conn, scope)
            notify(url, fam.name)
    finally:
        backend.dispose()


def _render(host: Host, out: TextIO, started: float, seconds: float, tty: bool) -> None:
    sup = host.supervisors[0]
    lines = [
        f"apsup demo  ·  SQLite {sup.backend.describe()}  ·  mode global  ·  "
        f"term {sup.term.generation if sup.term else '-'}  ·  "
        f"{time.monotonic() - started:5.1f}s / {seconds:.0f}s  (Ctrl-C to stop)",
        "",
        f"{'family':<15}{'policy':<16}{'capacity':>9}{'running':>9}{'ready':>7}"
        f"{'retry-wait':>12}{'completed':>11}{'failed':>8}",
    ]
    snaps = sup.core.snapshot() if sup.core else {}
    for name, fam in sorted(sup.families.items()):
        snap = snaps.get(name)
        running = getattr(snap, "running", 0)
        lines.append(
            f"{name:<15}{fam.policy.describe():<16}{f'{running}/{fam.max_workers}':>9}"
            f"{running:>9}{getattr(snap, 'ready', 0):>7}{getattr(snap, 'retry_wait', 0):>12}"
            f"{sup.completed[name]:>11}{sup.failed[name]:>8}"
        )
    text = "\n".join(lines)
    if tty:
        out.write("\x1b[H\x1b[2J" + text + "\n")
    else:
        out.write(text + "\n\n")
    out.flush()


def run_demo(
    db_path: str = "var/demo.db", seconds: float = 20.0, out: TextIO | None = None
) -> dict[str, int]:
    """Run the demo; returns completed invocations per family."""
    out = out or sys.stdout
    path = Path(db_path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    for suffix in ("", "-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    url = f"sqlite:///{path}"
    migrate(url)
    families = list(registry)
    bundle = build_host(url, families, shutdown_grace=5.0)
    host = bundle.host
    stop = threading.Event()
    producer = threading.Thread(target=_produce, args=(url, families, stop), daemon=True)
    tty = out.isatty() and os.environ.get("TERM", "") != "dumb"
    started = time.monotonic()
    last_render = 0.0
    try:
        host.install_signal_handlers()
        host.start()
        producer.start()
        while not host.stopping.is_set() and time.monotonic() - started < seconds:
            host.cycle(max_wait=0.25)
            if time.monotonic() - last_render >= (0.5 if tty else 2.0):
                last_render = time.monotonic()
                _render(host, out, started, seconds, tty)
    finally:
        stop.set()
        producer.join(timeout=5)
        _render(host, out, started, seconds, tty)
        completed = dict(host.supervisors[0].completed)
        host.shutdown()
        bundle.close()
    out.write(
        "demo finished: "
        + ", ".join(f"{name} {count} completed" for name, count in sorted(completed.items()))
        + f"\ndatabase kept at {path} (inspect with `apsup status --db {path}`)\n"
    )
    return completed
