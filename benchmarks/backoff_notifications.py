"""Notifications with many Scopes in backoff: what a new request costs the leader.

A real host (``build_host``, real Workers) first runs ``--scopes`` Scopes whose processor
fails: each fails once and waits in backoff (two hours), its request still pending. Then, for
``--seconds``, an application thread requests a new Scope (whose processor succeeds) every
``--interval`` seconds and notifies the host, as ``fam.request`` in the same process does. The
host's request pages and all its SQL statements are counted over that window, twice in the
same run: as shipped (request pages leave out the Scopes this term holds in backoff) and with
that filter off (every pass reads every pending request, as before), which is the reference.

Prints, on lines of their own::

    <backend> N in backoff: request pages/s X (filter off Y), per new request x (y),
        statements/s S (T), new requests handled n (m)

    .venv/bin/python benchmarks/backoff_notifications.py [--scopes 20000] [--seconds 20]
        [--interval 0.2] [--backend sqlite|mysql] [--mysql URL] [--out FILE | -]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _processes import PhaseFailed, progress, stop_on_signals
from _report import context_line, write_results

MODULE = "apsup_bench_backoff_family"
SOURCE = '''"""benchmarks/backoff_notifications.py's family: fail.* fails, anything else works."""
from apsup.registry import family


@family("bench-backoff", max_workers=8, timeout=60)
def bench_backoff(scope_id, ctx):
    if scope_id.startswith("fail."):
        raise RuntimeError("fails, and waits in backoff")
'''
#: Failing Scopes stay in backoff for the whole run: longer than the failing phase takes (on
#: SQLite each failure writes its failure state, ~75 per second on 2 cores), else the expired
#: backoffs fill every slot with retries and the window measures those instead.
BACKOFF_SECONDS = 7200.0


@dataclass
class Window:
    pages: int
    statements: int
    requested: int
    handled: int
    seconds: float


class _Pages:
    """Host hooks counting request pages (the family has no automatic check)."""

    def __init__(self) -> None:
        from apsup.supervisor.supervisor import Hooks

        class Counter(Hooks):
            pages = 0

            def observe_discovery(self, family: str, seconds: float) -> None:
                Counter.pages += 1

        self.hooks = Counter()

    @property
    def pages(self) -> int:
        return type(self.hooks).pages  # type: ignore[attr-defined, no-any-return]


@contextlib.contextmanager
def _filter(enabled: bool) -> Iterator[None]:
    """``enabled=False``: request pages read every pending request (the reference)."""
    from apsup.store import intents

    original = intents.request_page

    def unfiltered(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("backoff_at", None)
        return original(*args, **kwargs)

    if not enabled:
        intents.request_page = unfiltered  # type: ignore[assignment]
    try:
        yield
    finally:
        intents.request_page = original  # type: ignore[assignment]


def run(url: str, scopes: int, seconds: float, interval: float, filtered: bool) -> Window:
    import importlib

    from sqlalchemy import event

    from apsup.scheduling import Backoff, KeyState
    from apsup.store import migrate, open_backend
    from apsup.supervisor.launcher import build_host

    migrate(url)
    fam = importlib.import_module(MODULE).bench_backoff
    pages = _Pages()
    backoff = Backoff(base=BACKOFF_SECONDS, factor=2.0, cap=BACKOFF_SECONDS, jitter=0.0)
    bundle = build_host(url, [fam], hooks=pages.hooks, backoff=backoff, shutdown_grace=5.0)
    host, sup = bundle.host, bundle.host.supervisors[0]
    app = open_backend(url)
    try:
        with _filter(filtered):
            host.start()
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3.0:  # past the term's clock margin
                host.cycle(max_wait=0.2)
            names = [f"fail.{i:06d}" for i in range(scopes)]
            for i in range(0, scopes, 5000):
                with app.transaction() as conn:
                    fam.request_many(conn, names[i : i + 5000])
            sup.notify(fam.name)
            progress(f"{scopes} failing Scopes requested; running each once")
            started, last = time.monotonic(), 0.0
            while sup.failed[fam.name] < scopes:
                host.cycle(max_wait=0.5)
                if time.monotonic() - last > 15:
                    last = time.monotonic()
                    progress(f"  {sup.failed[fam.name]} / {scopes} failed once")
                if time.monotonic() - started > 30 + scopes / 50:
                    raise PhaseFailed(f"only {sup.failed[fam.name]} of {scopes} failed in time")
            core = sup.core
            assert core is not None
            waiting = sum(1 for s in core.keys(fam.name).values() if s is KeyState.RETRY_WAIT)
            progress(f"{waiting} Scopes in backoff; measuring {seconds:g} s")
            statements = [0]

            def count(*_: Any) -> None:
                statements[0] += 1

            backend: Any = bundle.backend
            # execution_options() views share their engine's events: the real engines only.
            found = (getattr(backend, "engine", None), getattr(backend, "read_engine", None))
            engines = list({id(e.engine): e.engine for e in found if e is not None}.values())
            for engine in engines:
                event.listen(engine, "before_cursor_execute", count)
            stop = threading.Event()
            requested: list[int] = []

            def publisher() -> None:
                i = 0
                while not stop.is_set():
                    with app.transaction() as conn:
                        fam.request(conn, f"new.{i:06d}")
                    requested.append(i)
                    host.supervisors[0].notify(fam.name)
                    host.wake()
                    i += 1
                    stop.wait(interval)

            before_pages, before_done = pages.pages, sup.completed[fam.name]
            thread = threading.Thread(target=publisher, daemon=True)
            start = time.monotonic()
            thread.start()
            while time.monotonic() - start < seconds:
                host.cycle(max_wait=0.2)
            stop.set()
            thread.join(10)
            wall = time.monotonic() - start
            for engine in engines:
                event.remove(engine, "before_cursor_execute", count)
            return Window(
                pages.pages - before_pages,
                statements[0],
                len(requested),
                sup.completed[fam.name] - before_done,
                wall,
            )
    finally:
        host.shutdown()
        bundle.close()
        app.dispose()


def main(argv: list[str] | None = None) -> int:
    import logging

    stop_on_signals()
    logging.getLogger("apsup").setLevel(logging.ERROR)  # a warning per failing Scope otherwise
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scopes", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--backend", choices=["sqlite", "mysql"], default="sqlite")
    parser.add_argument("--mysql", default=os.environ.get("APSUP_TEST_MYSQL_URL"))
    parser.add_argument("--out", default=None, help="Markdown file, '-' for none")
    args = parser.parse_args(argv)
    if args.scopes < 1 or args.seconds <= 0 or args.interval <= 0:
        print("backoff_notifications: --scopes, --seconds and --interval must be > 0")
        return 2
    if args.backend == "mysql" and not args.mysql:
        print("backoff_notifications: --backend mysql needs --mysql URL (or APSUP_TEST_MYSQL_URL)")
        return 2
    with tempfile.TemporaryDirectory(prefix="apsup-bench-backoff-") as tmp:
        folder = Path(tmp)
        (folder / f"{MODULE}.py").write_text(SOURCE)
        sys.path.insert(0, str(folder))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p
        )
        results: dict[bool, Window] = {}
        for filtered in (True, False):
            label = "as shipped" if filtered else "filter off"
            progress(f"{args.backend}, {label}")
            if args.backend == "sqlite":
                url = f"sqlite:///{folder / f'bench-{int(filtered)}.db'}"
                results[filtered] = run(url, args.scopes, args.seconds, args.interval, filtered)
            else:
                from intake import mysql_url

                with mysql_url(args.mysql) as url:
                    results[filtered] = run(url, args.scopes, args.seconds, args.interval, filtered)
            w = results[filtered]  # each half on its own line: a long run stopped later keeps it
            progress(
                f"{label}: {w.pages} request pages for {w.requested} new requests "
                f"({w.pages / max(1, w.requested):.2f} each), {w.statements / w.seconds:.0f} "
                f"statements/s, {w.handled} handled"
            )
    on, off = results[True], results[False]

    def rate(w: Window, n: int) -> float:
        return n / w.seconds

    line = (
        f"{args.backend} {args.scopes} in backoff: request pages/s {rate(on, on.pages):.1f} "
        f"(filter off {rate(off, off.pages):.1f}), per new request "
        f"{on.pages / max(1, on.requested):.2f} ({off.pages / max(1, off.requested):.2f}), "
        f"statements/s {rate(on, on.statements):.0f} ({rate(off, off.statements):.0f}), "
        f"new requests handled {on.handled}/{on.requested} ({off.handled}/{off.requested})"
    )
    print(line)
    if args.out != "-":
        out = args.out or f"benchmarks/results/backoff_notifications_{args.backend}.md"
        rows = [
            [label, w.requested, w.handled, w.pages, round(rate(w, w.pages), 1),
             round(w.pages / max(1, w.requested), 2), round(rate(w, w.statements))]
            for label, w in (("as shipped", on), ("filter off", off))
        ]  # fmt: skip
        write_results(
            Path(out).stem,
            f"New requests with {args.scopes} Scopes in backoff ({args.backend})",
            ["run", "new requests", "handled", "request pages", "pages/s", "pages per request",
             "statements/s"],
            rows,
            notes=[line],
            intro=context_line(),
            directory=Path(out).parent,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
