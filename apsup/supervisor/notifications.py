"""PostgreSQL wake-ups: a publisher's commit notifies, the leader listens (LISTEN/NOTIFY).

Publisher side: ``request``/``mark_dirty`` on a PostgreSQL connection add one ``pg_notify`` to
the caller's own transaction. PostgreSQL delivers it only if that transaction commits, and only
after the commit is visible, so the leader needs no barrier before it reads the request (the
UDP nudge of MySQL needs one). At most one notification per family per ``MIN_INTERVAL`` leaves a
process: a burst of requests costs the leader one wake-up; the ones left out are found by the
fast poll that follows every wake-up.

Leader side: ``NotificationListener`` holds one dedicated autocommit connection that LISTENs;
its socket joins the host's wait. After every (re)connect the leader runs a full request pass
(notifications sent while it was not listening are lost). A dead connection is noticed by the
error its socket reports (keepalives find a silent peer) and replaced, with a backoff. Where
notifications cannot work (the server refuses, or PgBouncer in transaction mode, where LISTEN
does not follow the session) the poll alone finds requests, as it always can.

Notifications only wake: they change no state, and one that is lost costs a poll interval.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from sqlalchemy import Connection, text
from sqlalchemy.engine import URL, make_url

from apsup.store.elected import FENCE_TIMEOUT_PARAM
from apsup.store.limits import strip_limits

log = logging.getLogger("apsup.notifications")

CHANNEL = "apsup_wake"
#: A publisher process notifies a family at most once per this many seconds.
MIN_INTERVAL = 0.05
#: Family names the leader reads per drain (the rest wait in the connection's buffer).
DRAIN_LIMIT = 256
#: Reconnect backoff of the leader's listening connection.
RETRY_FIRST, RETRY_MAX = 1.0, 30.0
#: The payload a leader treats as "run a full request pass".
ALL = "*"

_NOTIFY = text("SELECT pg_notify(:channel, :family)")
#: (database URL, family) -> when this process last notified it (monotonic).
_sent: dict[tuple[str, str], float] = {}
#: Publishers may turn notifications off (``set_enabled``); the poll then finds requests.
_enabled = True


def set_enabled(enabled: bool) -> None:
    """Switch this process's notifications on or off (off: the leaders' poll finds requests)."""
    global _enabled
    _enabled = enabled


def notify_in_transaction(conn: Connection, family: str) -> None:
    """Queue a notification of ``family`` in ``conn``'s transaction (sent at its COMMIT)."""
    if not _enabled:
        return
    key = (str(conn.engine.url), family)
    now = time.monotonic()
    last = _sent.get(key)
    if last is not None and now - last < MIN_INTERVAL:
        return
    _sent[key] = now
    conn.execute(_NOTIFY, {"channel": CHANNEL, "family": family})


def libpq_params(url: str | URL) -> dict[str, Any]:
    """psycopg connection parameters for a SQLAlchemy PostgreSQL URL (apsup's own query
    parameters removed), with keepalives so that a silent peer is noticed within seconds."""
    u = strip_limits(make_url(url).difference_update_query([FENCE_TIMEOUT_PARAM]))
    params: dict[str, Any] = {k: v for k, v in u.query.items() if isinstance(v, str)}
    params.update(
        host=u.host or "localhost",
        port=u.port or 5432,
        dbname=u.database or "postgres",
        connect_timeout=2,
        keepalives=1,
        keepalives_idle=5,
        keepalives_interval=2,
        keepalives_count=2,
        application_name="apsup-listener",
    )
    if u.username:
        params["user"] = u.username
    if u.password:
        params["password"] = u.password
    return params


class NotificationListener:
    """The leader's LISTEN connection (see the module docstring)."""

    def __init__(self, url: str | URL, channel: str = CHANNEL) -> None:
        self.params = libpq_params(url)
        self.channel = channel
        self.conn: Any = None
        self.next_try = 0.0
        self.retry = RETRY_FIRST
        self.connects = 0
        #: Whether notifications currently reach this host (for its status).
        self.listening = False

    def fileno(self) -> int | None:
        return None if self.conn is None else int(self.conn.pgconn.socket)

    def _connect(self) -> bool:
        import psycopg

        try:
            conn = psycopg.connect(**self.params, autocommit=True)
            conn.execute(f'LISTEN "{self.channel}"')
        except Exception as exc:
            log.warning(
                "notifications unavailable: the poll alone finds requests until they are",
                extra={"error": f"{type(exc).__name__}: {str(exc)[:200]}", "retry": self.retry},
            )
            self.next_try = time.monotonic() + self.retry
            self.retry = min(RETRY_MAX, self.retry * 2)
            return False
        self.conn = conn
        self.retry = RETRY_FIRST
        self.connects += 1
        self.listening = True
        return True

    def _lost(self, exc: BaseException) -> None:
        log.warning(
            "notification connection lost: reconnecting",
            extra={"error": f"{type(exc).__name__}: {str(exc)[:200]}"},
        )
        self.close()
        self.next_try = time.monotonic()

    def drain(self) -> set[str]:
        """Family names notified since the last drain, ``{ALL}`` right after a (re)connect (what
        was sent meanwhile is lost: a full request pass), or nothing. Never blocks for long:
        a reconnect is tried at most once per backoff step and bounded by its connect timeout."""
        if self.conn is None:
            if time.monotonic() < self.next_try or not self._connect():
                return set()
            return {ALL}
        names: set[str] = set()
        try:
            pgconn = self.conn.pgconn
            pgconn.consume_input()
            for _ in range(DRAIN_LIMIT):
                n = pgconn.notifies()
                if n is None:
                    break
                names.add(n.extra.decode(errors="replace"))
            if pgconn.status != 0:  # CONNECTION_OK
                raise ConnectionError("the listening connection is no longer open")
        except Exception as exc:
            self._lost(exc)  # the reconnect's full pass covers what was lost with it
            return set()
        return names

    def due(self) -> float | None:
        """When the next reconnect attempt is due (monotonic), while not connected."""
        return self.next_try if self.conn is None else None

    def close(self) -> None:
        conn, self.conn = self.conn, None
        self.listening = False
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


__all__ = [
    "ALL",
    "CHANNEL",
    "NotificationListener",
    "libpq_params",
    "notify_in_transaction",
    "set_enabled",
]
