"""Wake-ups between replicas on MySQL/OceanBase: a best-effort nudge to the leaders on commit.

The leader's poll (one statement for all its families, fast while busy, every ``POLL_SECONDS``
when idle) finds every request committed by another process; it stays the safety net. The nudge
only makes that sooner. When ``request``/``mark_dirty`` run on a MySQL connection:

1. in the caller's transaction, the publisher looks up the HTTP addresses of the replicas that
   hold the family's Lease (``global`` or ``artifact:<family>``; membership rows joined to the
   Lease table, one read, cached per process for ``CACHE_SECONDS``);
2. just before the driver's COMMIT (SQLAlchemy's ``commit`` event), it sends each of them one
   UDP datagram naming the family and one Scope it wrote, to the same host and port number as
   their HTTP listener. The send never blocks and never raises into the caller's commit;
3. the leader, woken by the datagram, takes a lock on that Scope's intent row
   (``SELECT ... FOR UPDATE``): the publisher holds that row's lock until its COMMIT, so the
   read waits for the commit and then sees it. The family is then notified as if its poll had
   found the request, and the poll runs fast for a few seconds (more requests tend to follow).

Datagrams are not authenticated: anyone who can reach the port can make a leader lock one
intent row and read one request page per family it leads, at most once per ``MIN_INTERVAL``.
They change no state. A nudge that is lost, late or spoofed costs at most that; a request
whose nudge never arrives is found by the poll as before.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
import weakref
from urllib.parse import urlsplit

from sqlalchemy import Connection, event, select

from apsup.store.schema import leases, replicas

log = logging.getLogger("apsup.nudge")

MAGIC = b"apsup-nudge1\0"
MAX_DATAGRAM = 512
#: How long a publisher process trusts its view of who leads a family.
CACHE_SECONDS = 5.0
#: The leader handles at most this many nudges per ``MIN_INTERVAL`` (a flood costs it a bounded
#: number of row locks and page reads).
DRAIN_LIMIT = 32
MIN_INTERVAL = 0.02

# -- publisher side -------------------------------------------------------------------------------

#: (database URL, family) -> (addresses, looked up at monotonic time).
_leaders: dict[tuple[str, str], tuple[list[tuple[str, int]], float]] = {}
#: Per connection, the (family, Scope) pairs its current transaction will announce.
_pending: weakref.WeakKeyDictionary[Connection, dict[str, str]] = weakref.WeakKeyDictionary()
_sender: socket.socket | None = None


def encode(family: str, scope_id: str) -> bytes:
    data = MAGIC + family.encode() + b"\0" + scope_id.encode()
    if len(data) > MAX_DATAGRAM:  # a Scope too long to name: the leader polls instead
        data = MAGIC + family.encode() + b"\0"
    return data


def decode(data: bytes) -> tuple[str, str] | None:
    if not data.startswith(MAGIC):
        return None
    family, sep, scope = data[len(MAGIC) :].partition(b"\0")
    if not sep or not family:
        return None
    try:
        return family.decode(), scope.decode()
    except UnicodeDecodeError:
        return None


def _addresses(conn: Connection, family: str) -> list[tuple[str, int]]:
    """The leaders' listener addresses for ``family`` (cached; one read when stale)."""
    key = (str(conn.engine.url), family)
    now = time.monotonic()
    hit = _leaders.get(key)
    if hit is not None and now - hit[1] < CACHE_SECONDS:
        return hit[0]
    rows = conn.execute(
        select(replicas.c.http_address)
        .select_from(leases.join(replicas, replicas.c.holder_id == leases.c.holder_id))
        .where(leases.c.supervisor_key.in_(["global", f"artifact:{family}"]))
    ).all()
    found = []
    for (address,) in rows:
        parts = urlsplit(address or "")
        if parts.hostname and parts.port:
            found.append((parts.hostname, parts.port))
    _leaders[key] = (found, now)
    return found


def nudge_on_commit(conn: Connection, family: str, scope_id: str) -> None:
    """Announce ``family`` (and one Scope its transaction wrote) to its leaders when ``conn``'s
    transaction commits. MySQL/OceanBase: a datagram after the commit (a failed lookup only
    skips it); PostgreSQL: a notification in the transaction (``supervisor.notifications``)."""
    if conn.dialect.name == "postgresql":
        from apsup.supervisor.notifications import notify_in_transaction

        notify_in_transaction(conn, family)  # delivered after the COMMIT: no barrier needed
        return
    if conn.dialect.name not in {"mysql", "mariadb"}:
        return
    try:
        if not _addresses(conn, family):
            return
    except Exception:  # no membership table yet, a blip: the poll finds the request
        log.debug("nudge lookup failed", exc_info=True)
        return
    pending = _pending.get(conn)
    if pending is None:
        pending = _pending[conn] = {}
        event.listen(conn, "commit", _on_commit)
        event.listen(conn, "rollback", _on_rollback)
    pending.setdefault(family, scope_id)


def _on_commit(conn: Connection) -> None:
    global _sender
    try:
        pending = _pending.get(conn)
        if not pending:
            return
        items = list(pending.items())
        pending.clear()
        url = str(conn.engine.url)
        if _sender is None:
            _sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            _sender.setblocking(False)
        for family, scope in items:
            hit = _leaders.get((url, family))
            for host, port in hit[0] if hit else []:
                with contextlib.suppress(OSError):
                    _sender.sendto(encode(family, scope), (host, port))
    except Exception:  # pragma: no cover - a nudge is never worth a failed commit
        log.debug("nudge send failed", exc_info=True)


def _on_rollback(conn: Connection) -> None:
    pending = _pending.get(conn)
    if pending:
        pending.clear()


# -- leader side ----------------------------------------------------------------------------------


class NudgeListener:
    """The UDP socket a host on MySQL listens on for nudges: the same host and port number as
    its HTTP listener (so membership's ``http_address`` names both)."""

    def __init__(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.sock.bind((host, port))
        self.quiet_until = 0.0

    def fileno(self) -> int:
        return self.sock.fileno()

    def drain(self) -> list[tuple[str, str]]:
        """Up to ``DRAIN_LIMIT`` nudges (family, Scope), deduplicated; the rest wait in the
        kernel until the next drain."""
        out: dict[tuple[str, str], None] = {}
        for _ in range(DRAIN_LIMIT):
            try:
                data = self.sock.recv(MAX_DATAGRAM + 1)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            item = decode(data)
            if item is not None:
                out[item] = None
        self.quiet_until = time.monotonic() + MIN_INTERVAL
        return list(out)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def forget_leaders() -> None:
    """Drop the publisher's cached leader addresses (tests; a process that knows better)."""
    _leaders.clear()


__all__ = ["NudgeListener", "decode", "encode", "forget_leaders", "nudge_on_commit"]
