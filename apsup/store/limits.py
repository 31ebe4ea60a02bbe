"""Finite time limits on the host's database calls, read from the database URL's query.

The host drives every Supervisor, its lease renewal and its Worker pool from one thread. A call
that never returns (a half-open TCP connection: the server vanished without a FIN or RST; a
SQLite write lock held by a Worker for minutes) would freeze all of it while the host still
looks alive. So the host's own connections ("control" connections) carry limits:

- ``apsup_connect_timeout`` (default 2 s): TCP connect and handshake (MySQL/OceanBase).
- ``apsup_read_timeout`` (default 5 s): the client waits at most this long for any reply
  and for a send to complete (PyMySQL ``read_timeout``/``write_timeout``). This is what ends a
  half-open connection. A call on a pooled connection that went half-open ends within
  ``apsup_read_timeout + apsup_connect_timeout`` (the liveness ping, then a new connection).
  Their sum must be shorter than ``LEASE_SECONDS``, so a host cut off from the database learns
  it before its Lease runs out.
- ``apsup_query_timeout`` (default 4 s, 0 = the server's own): the server ends a statement,
  lock waits included, after this long (OceanBase ``ob_query_timeout``; on MySQL
  ``max_execution_time`` for reads and ``innodb_lock_wait_timeout``). It must be shorter than
  ``apsup_read_timeout`` so a slow statement ends with the server's clean error first.
- ``apsup_lock_wait`` (default 2 s, SQLite): how long a control write waits for the database
  write lock (a Worker's transaction may hold it) before it fails and is retried at a later step.

One transaction attempt plus its retries is bounded by ``apsup_read_timeout`` (MySQL) or
``apsup_lock_wait`` (SQLite) in total. Worker connections keep the processor's own limits: a
Worker is bounded by its family's timeout, after which the pool kills it.

The parameters travel in the URL so every process (host, CLI, Workers) parses the same values;
each backend strips them before the URL reaches the driver.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sqlalchemy.engine import URL, make_url

from apsup.errors import ConfigError

CONNECT_TIMEOUT = "apsup_connect_timeout"
READ_TIMEOUT = "apsup_read_timeout"
QUERY_TIMEOUT = "apsup_query_timeout"
LOCK_WAIT = "apsup_lock_wait"
PARAMS = (CONNECT_TIMEOUT, READ_TIMEOUT, QUERY_TIMEOUT, LOCK_WAIT)


@dataclass(frozen=True)
class DbLimits:
    """Time limits (seconds) of control connections; see the module docstring."""

    connect_timeout: float = 2.0
    read_timeout: float = 5.0
    query_timeout: float = 4.0
    lock_wait: float = 2.0


def _seconds(url: URL, name: str, default: float, *, zero_ok: bool) -> float:
    raw = url.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(str(raw))
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0 (0 = the server's default)" if zero_ok else "> 0"
        raise ConfigError(
            f"database URL parameter {name} must be a number of seconds {bound}, got {raw!r}"
        )
    return value


def parse_limits(url: str | URL) -> DbLimits:
    """The limits in ``url``'s query (defaults for those absent); ``ConfigError`` names a bad
    parameter and what it must be."""
    u = make_url(url) if isinstance(url, str) else url
    d = DbLimits()
    limits = DbLimits(
        connect_timeout=_seconds(u, CONNECT_TIMEOUT, d.connect_timeout, zero_ok=False),
        read_timeout=_seconds(u, READ_TIMEOUT, d.read_timeout, zero_ok=False),
        query_timeout=_seconds(u, QUERY_TIMEOUT, d.query_timeout, zero_ok=True),
        lock_wait=_seconds(u, LOCK_WAIT, d.lock_wait, zero_ok=False),
    )
    if limits.query_timeout >= limits.read_timeout:
        raise ConfigError(
            f"database URL parameter {QUERY_TIMEOUT} ({limits.query_timeout:g}s) must be "
            f"shorter than {READ_TIMEOUT} ({limits.read_timeout:g}s), so the server ends a slow "
            "statement before the client gives up on the connection"
        )
    return limits


def explicit(url: str | URL) -> set[str]:
    """The limit parameters ``url`` sets itself."""
    u = make_url(url) if isinstance(url, str) else url
    return {name for name in PARAMS if u.query.get(name) not in (None, "")}


def strip_limits(url: str | URL) -> URL:
    """``url`` without the limit parameters (the drivers would reject them)."""
    u = make_url(url) if isinstance(url, str) else url
    return u.difference_update_query(PARAMS)
