"""Leases from database time, for the backends several replicas share (MySQL/OceanBase,
PostgreSQL): claim, renew, release and the fence, each written once.

A dialect module supplies only what differs: how database time is read (``_db_now``, always in
a statement of its own *after* the Lease row is locked, so a lock wait can never make an expired
term look valid) and how a session's transaction is bounded before it locks (``_bound``).
SQLite does not elect: one host owns the file and its terms never expire (``store.sqlite``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import Connection, update
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import IntegrityError

from apsup.errors import ConfigError
from apsup.store import intents
from apsup.store.base import SqlBackend
from apsup.store.leases import (
    GLOBAL_KEY,
    INVALIDATED,
    Term,
    is_live,
    other_mode_keys,
    read_lease,
    refuse_mode_conflict,
    take_lease,
    validate,
)
from apsup.store.schema import leases
from apsup.store.violations import is_duplicate_key

#: How long a fenced transaction may stay open before the server ends it (URL query
#: ``apsup_fence_timeout=SECONDS``; 0: unbounded). Its Lease row lock would otherwise keep the
#: leader from renewing. Workers get the bound their Lease policy allows (``bounded_fence_url``).
FENCE_TIMEOUT_PARAM = "apsup_fence_timeout"
FENCE_TIMEOUT_SECONDS = 30.0


def fence_timeout(url: URL) -> float:
    """The fence bound ``url`` asks for (``FENCE_TIMEOUT_SECONDS`` when it names none)."""
    raw = url.query.get(FENCE_TIMEOUT_PARAM)
    try:
        return FENCE_TIMEOUT_SECONDS if raw is None else float(str(raw))
    except ValueError:
        raise ConfigError(
            f"database URL parameter {FENCE_TIMEOUT_PARAM} must be a number of seconds"
        ) from None


def bounded_fence_url(url: str, seconds: float) -> str:
    """``url`` with its fenced transactions bounded by ``seconds`` at most (a bound the URL
    sets already is kept when it is shorter)."""
    u = make_url(url)
    raw = u.query.get(FENCE_TIMEOUT_PARAM)
    try:
        current = FENCE_TIMEOUT_SECONDS if raw is None else float(str(raw))
    except ValueError:
        return url  # reported by the backend that parses it
    if 0 < current <= seconds:
        return url
    bound = u.update_query_dict({FENCE_TIMEOUT_PARAM: f"{seconds:.3f}"})
    return bound.render_as_string(hide_password=False)


class ElectedBackend(SqlBackend):
    """A backend whose terms are Leases that run out in database time."""

    # -- dialect hooks ----------------------------------------------------------------------
    def _db_now(self, conn: Connection) -> datetime:
        """Database time, naive UTC, read in its own statement on ``conn``."""
        raise NotImplementedError

    def _bound(self, conn: Connection) -> None:
        """Bound this session's transactions before the Lease row is locked (where the
        backend needs a statement for it; most set it at connect)."""

    # -- time and the fence -----------------------------------------------------------------
    def now(self) -> datetime:
        with self.read() as conn:
            return self._db_now(conn)

    def _lease_expiry(self, conn: Connection, lease_seconds: float) -> datetime | None:
        return self._db_now(conn) + timedelta(seconds=lease_seconds)

    def _lock_term(self, conn: Connection, term: Term) -> None:
        self._bound(conn)
        row = read_lease(conn, term.supervisor_key, for_update=True)
        # Expiry is judged only now that the row lock is held: a time read before or with the
        # lock wait would be as old as the wait.
        validate(row, term, self._db_now(conn))

    # -- reads ------------------------------------------------------------------------------
    def read_intents(self, binding: str, scope_ids: Sequence[str]) -> dict[str, intents.Intent]:
        """The host's dispatch read for the keys it is about to start: one statement over the
        network, not one per Scope."""
        with self.read() as conn:
            return intents.get_many(conn, binding, scope_ids)

    # -- leases -----------------------------------------------------------------------------
    def claim_term(
        self, key: str, holder_id: str, lease_seconds: float, free_for: float = 0.0
    ) -> Term | None:
        """Take the Lease if it is free or expired; takeover always increments generation.

        ``free_for``: take it only once it has been free (released, or run out) for that many
        seconds of database time: a replica that is not the preferred leader of the key lets
        the preferred one claim first (``apsup.supervisor.placement``).

        Refused (``ModeConflictError``) while a term of the other mode is live: a replica started
        in ``global`` beside running ``dedicated`` ones (or the reverse) would otherwise hold a
        second valid term over the same Scopes. An expired term of the other mode is no obstacle:
        its Workers fail their fenced check by expiry.
        """

        def body(conn: Connection) -> Term | None:
            self._bound(conn)
            if key != GLOBAL_KEY:
                read_lease(conn, GLOBAL_KEY, for_update=True)  # lock order: global row first
            row = read_lease(conn, key, for_update=True)
            now = self._db_now(conn)
            expires = now + timedelta(seconds=lease_seconds)
            wait = 0.0  # seconds until the Lease has been free for ``free_for``
            self.lapsed_holder.pop(key, None)
            if row is not None and row.expires_at is not None:
                free_since = row.expires_at
                if row.holder_id == INVALIDATED:
                    free_since = min(free_since, now)
                elif free_since <= now:
                    self.lapsed_holder[key] = row.holder_id  # ran out without a release
                wait = (free_since - now).total_seconds() + free_for
            if wait > 0:
                self.held_for[key] = wait
                return None
            self.held_for.pop(key, None)
            others = other_mode_keys(conn, key, for_update=True)
            refuse_mode_conflict(key, [r for r in others if is_live(r, now)])
            return take_lease(conn, key, holder_id, row, expires)

        try:
            return self.run(body)
        except IntegrityError as exc:
            if is_duplicate_key(exc):
                return None  # another candidate inserted the first Lease row concurrently
            raise

    def renew_term(self, term: Term, lease_seconds: float) -> bool:
        def body(conn: Connection) -> bool:
            self._bound(conn)
            row = read_lease(conn, term.supervisor_key, for_update=True)
            now = self._db_now(conn)
            try:
                validate(row, term, now)
            except Exception:
                return False
            conn.execute(
                update(leases)
                .where(leases.c.supervisor_key == term.supervisor_key)
                .values(expires_at=now + timedelta(seconds=lease_seconds))
            )
            self.renewed_at = (now, time.monotonic())
            return True

        return self.run(body)

    def release_term(self, term: Term) -> None:
        """Expire the Lease now so a standby can take over without waiting (no ABA: the next
        takeover increments generation)."""

        def body(conn: Connection) -> None:
            self._bound(conn)
            row = read_lease(conn, term.supervisor_key, for_update=True)
            if row is None or (row.holder_id, row.generation) != (term.holder_id, term.generation):
                return
            conn.execute(
                update(leases)
                .where(leases.c.supervisor_key == term.supervisor_key)
                .values(holder_id=INVALIDATED, expires_at=self._db_now(conn))
            )

        self.run(body)


__all__ = ["FENCE_TIMEOUT_PARAM", "ElectedBackend", "bounded_fence_url", "fence_timeout"]
