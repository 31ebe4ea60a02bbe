"""Invocations per family and minute (table ``family_minutes``), for the console's chart.

Leaders add what their Workers did (``add``): one row per binding and minute, counts only ever
grow, so two leaders of one minute (a takeover inside it) both count into the same row. The
chart of the last hour is read from here (``recent``), the same on every replica and across
takeovers. These are statistics, not business writes: they are not fenced (an old leader's
last counts are what its Workers really did) and a failed write only leaves a gap.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime

from sqlalchemy import Connection, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from apsup.store.schema import family_minutes
from apsup.store.violations import is_duplicate_key

c = family_minutes.c

#: Minutes of history kept; older rows are deleted by the leaders that write (``prune``).
KEPT_MINUTES = 120


def epoch_minute(moment: datetime) -> int:
    """Minutes since the epoch of a database time (naive UTC, as every backend returns it)."""
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    return int(aware.timestamp() // 60)


def add(conn: Connection, counts: Mapping[tuple[str, int], tuple[int, int]]) -> None:
    """Add (succeeded, failed) to each (binding, minute) row, creating missing rows."""
    for (binding, minute), (ok, bad) in sorted(counts.items()):
        if not ok and not bad:
            continue
        key = (c.binding_name == binding, c.minute == minute)
        grow = update(family_minutes).where(*key)
        grow = grow.values(succeeded=c.succeeded + ok, failed=c.failed + bad)
        if conn.execute(grow).rowcount:
            continue
        try:
            with conn.begin_nested():
                conn.execute(
                    insert(family_minutes).values(
                        binding_name=binding, minute=minute, succeeded=ok, failed=bad
                    )
                )
        except IntegrityError as exc:
            if not is_duplicate_key(exc):
                raise
            conn.execute(grow)  # another leader created the row meanwhile: add to it


def recent(
    conn: Connection, bindings: Iterable[str], since_minute: int
) -> dict[str, list[list[int]]]:
    """binding -> [[minute, succeeded, failed], ...] from ``since_minute`` on, oldest first."""
    names = list(bindings)
    if not names:
        return {}
    rows = conn.execute(
        select(c.binding_name, c.minute, c.succeeded, c.failed)
        .where(c.binding_name.in_(names), c.minute >= since_minute)
        .order_by(c.binding_name, c.minute)
    ).all()
    out: dict[str, list[list[int]]] = {}
    for binding, minute, ok, bad in rows:
        out.setdefault(str(binding), []).append([int(minute), int(ok), int(bad)])
    return out


def prune(conn: Connection, before_minute: int) -> int:
    """Delete the rows of minutes before ``before_minute``; returns how many."""
    return int(conn.execute(delete(family_minutes).where(c.minute < before_minute)).rowcount)
