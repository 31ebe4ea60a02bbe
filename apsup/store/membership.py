"""Replica membership (table ``replicas``): one row per running host process.

A host on an elected backend (MySQL/OceanBase) writes its row when it starts and refreshes
``last_seen`` on a timer of its own (``refresh_interval``: four times per Lease, leader or
standby, whatever its renewals do); it deletes the row on a clean shutdown. A row is judged gone
only once ``last_seen`` is older than ``gone_after`` (two Leases: eight refreshes missed in a
row), so a process that is late once, or a few times, never leaves anyone's view: placement
moves families only on a real join or leave (a process killed or cut off for that long has
lost its Leases already; a Lease that runs out is taken over on its own, without this view).
``/status`` and ``apsup status`` list the live rows with the Leases each one holds, and
``apsup status`` finds a host's HTTP listener here. A SQLite host keeps no row: it is the only
host, and its listener is recorded beside the database file.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from apsup.store.schema import replicas

#: Environment variable through which a dedicated launcher gives its per-family Supervisor
#: processes its own replica id (each process keeps a row; the id groups them).
REPLICA_ENV = "APSUP_REPLICA_ID"
#: Rows read at most (a deployment has a handful of replicas; this bounds a runaway).
MAX_MEMBERS = 200
#: Refreshes per Lease: a row stays fresh through several late or failed refreshes.
REFRESHES_PER_LEASE = 4
#: A row is judged gone after this many Leases without a refresh (the margin).
GONE_AFTER_LEASES = 2.0
#: Seconds a gone row is kept (the cluster view lists it as gone, with when it vanished).
GONE_KEPT_SECONDS = 3600.0
#: Refreshes between two prunes of rows gone for longer than ``GONE_KEPT_SECONDS``.
PRUNE_EVERY = 40


def refresh_interval(lease_seconds: float) -> float:
    """How often a host refreshes its row: ``REFRESHES_PER_LEASE`` times per Lease."""
    return lease_seconds / REFRESHES_PER_LEASE


def gone_after(lease_seconds: float) -> float:
    """How old ``last_seen`` must be before the row's process counts as gone."""
    return lease_seconds * GONE_AFTER_LEASES


@dataclass(frozen=True)
class Member:
    holder_id: str
    replica_id: str
    host_name: str
    pid: int
    version: str
    role: str
    mode: str
    http_address: str | None
    started_at: datetime
    last_seen: datetime

    def alive(self, now: datetime, lease_seconds: float) -> bool:
        """Whether the row's process counts as running at ``now`` (database time), judged
        with ``gone_after``'s margin over a Lease of ``lease_seconds``."""
        return now - self.last_seen <= timedelta(seconds=gone_after(lease_seconds))

    def as_dict(self) -> dict[str, Any]:
        return {
            "holder_id": self.holder_id,
            "replica_id": self.replica_id,
            "host": self.host_name,
            "pid": self.pid,
            "version": self.version,
            "role": self.role,
            "mode": self.mode,
            "http": self.http_address,
            "started_at": self.started_at.isoformat() + "Z",
            "last_seen": self.last_seen.isoformat() + "Z",
        }


def refresh(conn: Connection, member: Member, *, now: Any = None) -> None:
    """Write ``member`` (insert on first use, else update everything but ``started_at``). One
    statement once the row exists. ``now``: a SQL expression of database time for
    ``last_seen`` (and ``started_at`` of a new row) instead of the member's own values; on an
    autocommit connection (the host's reads) the write then costs a single round trip."""
    values: dict[str, Any] = {
        "replica_id": member.replica_id,
        "host_name": member.host_name[:255],
        "pid": member.pid,
        "version": member.version[:64],
        "role": member.role,
        "mode": member.mode,
        "http_address": member.http_address,
        "last_seen": member.last_seen if now is None else now,
    }
    where = replicas.c.holder_id == member.holder_id
    if conn.execute(update(replicas).where(where).values(**values)).rowcount:
        return
    started = member.started_at if now is None else now
    try:
        conn.execute(
            insert(replicas).values(holder_id=member.holder_id, started_at=started, **values)
        )
    except IntegrityError:  # a concurrent first write of the same process: never, but harmless
        conn.execute(update(replicas).where(where).values(**values))


def remove(conn: Connection, holder_id: str) -> None:
    conn.execute(delete(replicas).where(replicas.c.holder_id == holder_id))


def remove_replica(conn: Connection, replica_id: str) -> None:
    """Remove every row of ``replica_id``: a dedicated replica leaving as a whole (its
    per-family processes stop together), so the others stop counting on it at once."""
    conn.execute(delete(replicas).where(replicas.c.replica_id == replica_id))


def prune(conn: Connection, before: datetime) -> int:
    """Delete the rows last seen before ``before`` (processes gone long ago: killed, or cut off
    and never back), so they neither fill the ``MAX_MEMBERS`` rows read nor stay listed."""
    return int(conn.execute(delete(replicas).where(replicas.c.last_seen < before)).rowcount or 0)


def members(conn: Connection) -> list[Member]:
    return [Member(*r) for r in conn.execute(_select())]


def members_at(conn: Connection, now: Any) -> tuple[list[Member], datetime | None]:
    """The rows and database time (``now``: a SQL expression of it) in one statement; the
    time is None when there is no row."""
    rows = list(conn.execute(_select(now.label("db_now"))))
    return [Member(*r[:10]) for r in rows], (rows[0][10] if rows else None)


def _select(*extra: Any) -> Any:
    return (
        select(
            replicas.c.holder_id,
            replicas.c.replica_id,
            replicas.c.host_name,
            replicas.c.pid,
            replicas.c.version,
            replicas.c.role,
            replicas.c.mode,
            replicas.c.http_address,
            replicas.c.started_at,
            replicas.c.last_seen,
            *extra,
        )
        .order_by(replicas.c.replica_id, replicas.c.holder_id)
        .limit(MAX_MEMBERS)
    )
