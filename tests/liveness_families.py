"""Families for the liveness tests (module level: Workers import them by entry point).

``live-work`` runs one processor whose behaviour is chosen by the part of the Scope id before the
first ``.``; it talks to the test through files in the directory named by the Worker setting
``LIVE_DIR`` (``started.<scope>`` holds the Worker pid, ``go.<scope>`` releases a waiting one):

=========  ======================================================================================
ok         acknowledge
ackwait    acknowledge, write ``acked.<scope>``, then wait for ``go.<scope>`` before exiting
slow       sleep two minutes (a SIGTERM ends it)
stalewait  wait for ``go.<scope>``, then acknowledge (raises StaleTermError on an invalid term)
fakestale  attempt 1 (no ``attempt.<scope>`` file yet): raise StaleTermError although the term
           is valid; later attempts acknowledge
lateack    acknowledge, then sleep past the family timeout (``live-late`` has a 1 s timeout)
noack      return without acknowledging (the Supervisor acknowledges for it); first write into
           ``dbconns.<scope>`` how many descriptors the Worker holds on the database
noackwait  wait for ``go.<scope>``, then return without acknowledging
fencedpark sit inside ``ctx.fenced()`` for N seconds (``fencedpark.6``), then acknowledge
fail       raise RuntimeError, every time
ackfail    acknowledge, then raise RuntimeError
failslow   raise RuntimeError at the first attempt, then run for 120 s (a failing Scope, running)
count      append the G it was given to ``starts.<scope>``, then acknowledge
sysexit    ``sys.exit(N)`` with N the part after the first ``.`` (``sysexit.9``)
osexit     ``os._exit(N)``, likewise
=========  ======================================================================================

``live-scan`` checks every second (its StartScan is a fenced control write each time).
``live-recon`` has a reconciler run in the host process; ``RECON`` sets how many pages it
returns and how long each page's query takes (``SELECT SLEEP`` on MySQL: real database time).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, text

from apsup.context import ExecutionContext
from apsup.errors import StaleTermError
from apsup.registry import Family, Registry, family

registry = Registry()

#: Reconciler behaviour (host process only): pages to return, seconds per page, pages seen.
RECON: dict[str, Any] = {"pages": 1, "page_seconds": 0.0, "seen": 0}


def _dir(ctx: ExecutionContext) -> Path:
    return Path(ctx.settings["LIVE_DIR"])


def _wait_for(path: Path, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} never appeared")
        time.sleep(0.02)


def _ack(ctx: ExecutionContext) -> None:
    with ctx.fenced() as conn:
        ctx.acknowledge(conn)


def _database_connections(ctx: ExecutionContext) -> int:
    """Descriptors this process holds on the database: the SQLite file (with its -wal and
    -shm), or TCP sockets (a MySQL session: sockets listed in ``/proc/self/net/tcp*``)."""
    tcp: set[str] = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]:
                tcp.add(line.split()[9])  # the socket's inode
    sqlite_path = (
        ctx.database_url.removeprefix("sqlite:///") if "sqlite" in ctx.database_url else None
    )
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        session = target.startswith("socket:[") and target[8:-1] in tcp
        found += session or (sqlite_path is not None and target.startswith(sqlite_path))
    return found


def behave(scope_id: str, ctx: ExecutionContext) -> None:
    kind = scope_id.split(".", 1)[0]
    if kind == "ok" and "LIVE_DIR" not in ctx.settings:
        _ack(ctx)  # run by a Runtime, which passes no LIVE_DIR
        return
    d = _dir(ctx)
    (d / f"started.{scope_id}").write_text(str(os.getpid()))
    if kind == "ok":
        _ack(ctx)
    elif kind == "ackwait":
        _ack(ctx)
        (d / f"acked.{scope_id}").touch()
        _wait_for(d / f"go.{scope_id}")
    elif kind == "slow":
        time.sleep(120)
    elif kind == "stalewait":
        _wait_for(d / f"go.{scope_id}")
        _ack(ctx)
    elif kind == "fakestale":
        marker = d / f"attempt.{scope_id}"
        if not marker.exists():
            marker.touch()
            raise StaleTermError("simulated: the Worker believes the term moved on")
        _ack(ctx)
    elif kind == "noack":
        (d / f"dbconns.{scope_id}").write_text(str(_database_connections(ctx)))
    elif kind == "noackwait":
        _wait_for(d / f"go.{scope_id}")
    elif kind == "fencedpark":  # sit inside ctx.fenced() for N seconds, then acknowledge
        with ctx.fenced() as conn:
            (d / f"fenced.{scope_id}").touch()
            time.sleep(float(scope_id.split(".")[1]))
            ctx.acknowledge(conn)
    elif kind == "fail":
        raise RuntimeError("this Scope fails every time")
    elif kind == "count":  # one line per invocation: the G it was given
        with open(d / f"starts.{scope_id}", "a", encoding="utf-8") as fh:
            fh.write(f"{ctx.claimed_request_generation}\n")
        _ack(ctx)
    elif kind == "failslow":  # fails once, then runs for two minutes (a failing Scope, running)
        marker = d / f"attempt.{scope_id}"
        if not marker.exists():
            marker.touch()
            raise RuntimeError("the first attempt fails")
        (d / f"second.{scope_id}").touch()
        time.sleep(120)
    elif kind == "ackfail":  # its request handled, then a failure: backoff, nothing pending
        _ack(ctx)
        raise RuntimeError("this Scope fails after its acknowledgment")
    elif kind == "sysexit":  # sys.exit(N), N after the first dot
        sys.exit(int(scope_id.split(".")[1]))
    elif kind == "osexit":  # os._exit(N): no wrapper code runs after it
        os._exit(int(scope_id.split(".")[1]))
    elif kind == "lateack":
        _ack(ctx)
        time.sleep(30)
    else:
        raise ValueError(f"unknown kind {kind!r}")


@family("live-work", max_workers=4, timeout=60, registry=registry)
def live_work(scope_id: str, ctx: ExecutionContext) -> None:
    behave(scope_id, ctx)


@family("live-late", max_workers=2, timeout=1.0, registry=registry)
def live_late(scope_id: str, ctx: ExecutionContext) -> None:
    behave(scope_id, ctx)


@family("live-scan", interval=1.0, max_workers=2, timeout=60, registry=registry)
def live_scan(scope_id: str, ctx: ExecutionContext) -> None:
    behave(scope_id, ctx)


@family("live-recon", max_workers=2, timeout=60, registry=registry)
def live_recon(scope_id: str, ctx: ExecutionContext) -> None:
    behave(scope_id, ctx)


@live_recon.reconciler
def reconcile_pages(conn: Connection, fam: Family, token: Any) -> Any:
    """Page ``token`` (0-based) of ``RECON['pages']``; each page runs one real query."""
    page = 0 if token is None else int(token)
    seconds = float(RECON["page_seconds"])
    if seconds > 0 and conn.dialect.name == "mysql":
        conn.execute(text("SELECT SLEEP(:s)"), {"s": seconds}).all()
    else:
        conn.execute(text("SELECT 1")).all()
        if seconds > 0:
            time.sleep(seconds)
    RECON["seen"] = page + 1
    return None if page + 1 >= int(RECON["pages"]) else page + 1
