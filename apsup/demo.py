"""``apsup demo``: the reference families on the embedded SQLite default, with a live view.

It runs topic-memory, experience, profile and handoff (``apsup.families``) with demo-sized
intervals: independent policies and budgets, topic-memory's ordered journal with one poisoned
Scope that fails and backs off while its siblings keep completing, experience's partial
progress, profile's immediate cron catch-up producing Candidates for Review, and handoff running
only on explicit requests. Producers write domain input from a thread, as an application would
(input and intent in one transaction); each commit wakes the host by itself.
"""

from __future__ import annotations

import logging
import os
import random
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from apsup.families import experience, handoff, profile, topic_memory
from apsup.observability.metrics import SupervisorMetrics
from apsup.observability.worker_logs import WorkerLogRelay
from apsup.policy import Interval
from apsup.registry import Family
from apsup.store import migrate, open_backend
from apsup.supervisor.host import Host
from apsup.supervisor.launcher import build_host
from apsup.supervisor.runtime import MetricsHooks

POISONED_SCOPE = "topic-3"


def demo_families() -> list[Family]:
    """The reference families with intervals shortened so progress is visible in seconds."""
    return [
        topic_memory.FAMILY.with_overrides(policy=Interval(2), max_workers=3, timeout=30),
        experience.FAMILY.with_overrides(policy=Interval(3), max_workers=2, timeout=30),
        profile.FAMILY.with_overrides(max_workers=2, timeout=30),
        handoff.FAMILY.with_overrides(max_workers=2, timeout=30),
    ]


def _seed(url: str) -> None:
    backend = open_backend(url)
    try:
        with backend.transaction() as conn:
            for i in range(1, 5):
                profile.add_source(conn, f"profile-{i}", f"demo profile fact {i}")
            topic_memory.append_source(conn, POISONED_SCOPE, "first source")
            # A position that always fails: its Scope backs off, later Sources never overtake it.
            conn.execute(
                topic_memory.topic_poison.insert().values(scope_id=POISONED_SCOPE, position=2)
            )
    finally:
        backend.dispose()


def _produce(url: str, stop: threading.Event) -> None:
    backend = open_backend(url)
    rng = random.Random(7)
    try:
        while not stop.wait(0.1):
            kind = rng.choice(("topic", "topic", "experience", "handoff"))
            scope = f"{kind}-{rng.randint(1, 8)}"
            with backend.transaction() as conn:
                if kind == "topic":
                    topic_memory.append_source(conn, scope, f"demo note {rng.random():.6f}")
                elif kind == "experience":
                    experience.record_item(conn, scope, f"demo item {rng.random():.6f}")
                else:
                    handoff.request_handoff(conn, scope, f"demo://payload/{rng.randint(1, 99)}")
    finally:
        backend.dispose()


def _render(host: Host, out: TextIO, started: float, seconds: float, tty: bool) -> None:
    sup = host.supervisors[0]
    lines = [
        f"apsup demo  ·  SQLite {sup.backend.describe()}  ·  mode global  ·  "
        f"term {sup.term.generation if sup.term else '-'}  ·  "
        f"{time.monotonic() - started:5.1f}s / {seconds:.0f}s  (Ctrl-C to stop)",
        "",
        f"{'family':<14}{'policy':<30}{'capacity':>9}{'running':>9}{'ready':>7}"
        f"{'retry-wait':>12}{'completed':>11}{'failed':>8}",
    ]
    snaps = sup.core.snapshot() if sup.core else {}
    for name, fam in sorted(sup.families.items()):
        snap = snaps.get(name)
        running = getattr(snap, "running", 0)
        lines.append(
            f"{name:<14}{fam.policy.describe():<30}{f'{running}/{fam.max_workers}':>9}"
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
    migrate(url, reference_families=True)
    _seed(url)
    families = demo_families()
    # As ``apsup run`` does: the Workers' exceptions reach the host, which records their
    # message in the failure state (``apsup status`` then shows the real error).
    relay = WorkerLogRelay(level=logging.WARNING)  # the screen is the demo's own report
    hooks = MetricsHooks(SupervisorMetrics(families=[f.name for f in families]), relay)
    try:
        bundle = build_host(
            url, families, shutdown_grace=5.0, worker_settings=relay.env(), hooks=hooks
        )
    except BaseException:
        relay.close()
        raise
    host = bundle.host
    stop = threading.Event()
    producer = threading.Thread(target=_produce, args=(url, stop), daemon=True)
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
        relay.close()
    out.write(
        "demo finished: "
        + ", ".join(f"{name} {count} completed" for name, count in sorted(completed.items()))
        + f"\ndatabase kept at {path}; inspect it with:\n  {status_command(url)}\n"
    )
    return completed


def status_command(url: str) -> str:
    """A shell command that runs ``apsup status`` on ``url`` from the current folder, naming
    the ``apsup`` of this interpreter (``./run demo`` does not put it on PATH)."""
    candidates = [Path(sys.argv[0]), Path(sys.executable).with_name("apsup")]
    exe: list[str] = [sys.executable, "-m", "apsup.cli"]
    for candidate in candidates:
        if candidate.name == "apsup" and candidate.is_file() and os.access(candidate, os.X_OK):
            resolved = candidate.absolute()
            try:
                shown = str(resolved.relative_to(Path.cwd()))
            except ValueError:
                shown = str(resolved)
            exe = [shown if "/" in shown else f"./{shown}"]
            break
    return shlex.join([*exe, "status", "--db", url, "--once"])
