"""Warm the Workers' database engine once, in the forkserver.

Every Worker would otherwise build an engine, initialise the dialect and compile the same few
statements (duplicate check, Lease lock, acknowledgment): 15-25 ms per launch on a 2-core
machine, more than the launch itself. Imported as a forkserver preload, this module opens the
backend for the URL the host hands over, runs those statements once (the write ones in a
transaction that is rolled back and touches no row), then closes every connection: children
inherit a ready engine with its compiled-statement cache, its initialised dialect and an empty
pool, so no connection ever crosses a fork. The host hands the URL over in a private (0600)
file named by an environment variable, never in the environment itself (which
``/proc/<pid>/environ`` would keep showing); the file is removed as soon as it is read.
"""

from __future__ import annotations

import contextlib
import os

from apsup.context import backend_for
from apsup.store import backend_kind, intents, open_backend
from apsup.store.leases import Term, read_lease

ENV = "APSUP_WORKER_WARM_URL"
_PROBE = "\x1fapsup-warm"


def _answers(url: str) -> bool:
    """Whether the database answers within the host's time limits. The Workers' own engine has
    none: on a half-open network its handshake would wait for ever and the forkserver (and with
    it the host's startup) would hang instead of just starting cold."""
    probe = open_backend(url, control=True)
    try:
        with probe.read():
            return True
    except Exception:
        return False
    finally:
        probe.dispose()


def warm(url: str) -> None:
    if backend_kind(url) != "sqlite" and not _answers(url):
        return
    backend = backend_for(url)
    with backend.read() as conn:
        intents.get(conn, _PROBE, _PROBE)
    with contextlib.suppress(Exception), backend.engine.connect() as conn:
        txn = conn.begin()
        try:
            read_lease(conn, _PROBE, for_update=True)
            with contextlib.suppress(Exception):
                backend.check_term(conn, Term(_PROBE, _PROBE, 1))
            with contextlib.suppress(Exception):
                intents.acknowledge(conn, _PROBE, _PROBE, 1, 1)
            with contextlib.suppress(Exception):
                intents.mark_clean(conn, _PROBE, _PROBE, 1, 1)
        finally:
            txn.rollback()
    # No connection survives into a forked Worker. ``pool.dispose()`` closes the pooled
    # connections but keeps the pool itself, unlike ``engine.dispose()`` which replaces it: a
    # new pool runs the engine's first-connect work again (dialect initialisation, on SQLite
    # ``PRAGMA journal_mode=WAL``: 3-5 ms) in every Worker, for facts the forkserver already
    # established on this database.
    backend.engine.pool.dispose()


def _take_url() -> str | None:
    path = os.environ.pop(ENV, None)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip() or None
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


_url = _take_url()
if _url:
    with contextlib.suppress(Exception):  # a cold engine is slower, never wrong
        warm(_url)
