"""Leadership terms and the narrow Backend interface every backend implements.

A term is (supervisor_key, holder_id, supervisor_generation). Fencing means: inside the very
transaction that writes, lock the Lease row and check holder + generation (+ expiry on MySQL),
holding the lock through commit. A check in one transaction followed by a write in another is
never used (RFC §8).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, TypeVar

from sqlalchemy import Connection, Engine, bindparam, insert, select, update

from apsup.errors import ModeConflictError as ModeConflictError
from apsup.errors import StaleTermError
from apsup.store.schema import leases

T = TypeVar("T")

GLOBAL_KEY = "global"
#: holder_id written when a term is invalidated (shutdown, mode switch): matches no live holder.
INVALIDATED = ""


def new_holder_id() -> str:
    return uuid.uuid4().hex


def dedicated_key(family_name: str) -> str:
    return f"artifact:{family_name}"


def key_mode(key: str) -> str:
    """``global`` for the global key, ``dedicated`` for ``artifact:<family>`` keys."""
    return "global" if key == GLOBAL_KEY else "dedicated"


@dataclass(frozen=True)
class Term:
    supervisor_key: str
    holder_id: str
    generation: int


@dataclass(frozen=True)
class LeaseRow:
    supervisor_key: str
    holder_id: str
    generation: int
    expires_at: datetime | None


class Backend(Protocol):
    """What the Supervisor, Workers and domain code need from a database."""

    name: str
    engine: Engine

    def describe(self) -> str:
        """The URL with credentials removed, safe to log."""
        ...

    def transaction(self) -> AbstractContextManager[Connection]:
        """A write transaction (BEGIN IMMEDIATE on SQLite; READ COMMITTED on MySQL)."""
        ...

    def read(self) -> AbstractContextManager[Connection]:
        """A read-only transaction that does not take the SQLite write lock."""
        ...

    def fenced(self, term: Term) -> AbstractContextManager[Connection]:
        """A write transaction in which the Lease row is locked and validated for ``term``."""
        ...

    def run_fenced(self, term: Term, fn: Callable[[Connection], T]) -> T:
        """``fn`` in a fenced transaction, retried a bounded number of times on lock waits."""
        ...

    def run(self, fn: Callable[[Connection], T]) -> T:
        """``fn`` in a write transaction, with the same bounded retry."""
        ...

    def now(self) -> datetime:
        """Database time, naive UTC."""
        ...

    def claim_term(
        self, key: str, holder_id: str, lease_seconds: float, free_for: float = 0.0
    ) -> Term | None:
        """SQLite: always a new term. MySQL: a new term only if the Lease is expired/free (for
        ``free_for`` seconds at least)."""
        ...

    def renew_term(self, term: Term, lease_seconds: float) -> bool:
        """Extend a held Lease (MySQL); False means leadership is lost."""
        ...

    def release_term(self, term: Term) -> None:
        """Give up a term at shutdown so no leftover Worker of it can commit."""
        ...

    def invalidate_terms(self, keys: Iterable[str] | None = None) -> list[str]:
        """Invalidate active terms (all keys if None), advancing generations; mode switch."""
        ...

    def lease_rows(self) -> list[LeaseRow]: ...

    def dispose(self) -> None: ...


# Built once with a bound key: every fenced write runs it (see ``intents._GET`` for why).
_LEASE = select(
    leases.c.supervisor_key,
    leases.c.holder_id,
    leases.c.supervisor_generation,
    leases.c.expires_at,
).where(leases.c.supervisor_key == bindparam("p_key"))
_LEASE_FOR_UPDATE = _LEASE.with_for_update()


def read_lease(conn: Connection, key: str, *, for_update: bool) -> LeaseRow | None:
    stmt = _LEASE_FOR_UPDATE if for_update else _LEASE
    row = conn.execute(stmt, {"p_key": key}).first()
    if row is None:
        return None
    return LeaseRow(row[0], row[1], int(row[2]), row[3])


def validate(row: LeaseRow | None, term: Term, now: datetime | None) -> None:
    """Raise StaleTermError unless ``row`` is ``term`` and (when it expires) unexpired."""
    if row is None:
        raise StaleTermError(f"no lease row for supervisor key {term.supervisor_key!r}")
    if row.holder_id == INVALIDATED:
        raise StaleTermError(f"term {term.supervisor_key}#{row.generation} was invalidated")
    if row.holder_id != term.holder_id or row.generation != term.generation:
        raise StaleTermError(
            f"term {term.supervisor_key}#{term.generation} was superseded "
            f"(now generation {row.generation})"
        )
    if row.expires_at is not None and now is not None and row.expires_at <= now:
        raise StaleTermError(f"term {term.supervisor_key}#{term.generation} lease expired")


def is_live(row: LeaseRow, now: datetime | None) -> bool:
    """Held and (where leases expire) unexpired at ``now``."""
    if row.holder_id == INVALIDATED:
        return False
    return row.expires_at is None or now is None or row.expires_at > now


def other_mode_keys(conn: Connection, key: str, *, for_update: bool = False) -> list[LeaseRow]:
    """Lease rows of the mode ``key`` does not belong to (the global key vs every dedicated key).

    Both modes' claims lock the global row first (a dedicated claim takes it before its own),
    so two claims of different modes serialise on it instead of deadlocking.
    """
    stmt = select(
        leases.c.supervisor_key,
        leases.c.holder_id,
        leases.c.supervisor_generation,
        leases.c.expires_at,
    )
    if key == GLOBAL_KEY:
        stmt = stmt.where(leases.c.supervisor_key != GLOBAL_KEY).order_by(leases.c.supervisor_key)
    else:
        stmt = stmt.where(leases.c.supervisor_key == GLOBAL_KEY)
    if for_update:
        stmt = stmt.with_for_update()
    return [LeaseRow(r[0], r[1], int(r[2]), r[3]) for r in conn.execute(stmt)]


def refuse_mode_conflict(key: str, live: list[LeaseRow]) -> None:
    """Raise ModeConflictError naming the live term(s) of the other mode and the procedure."""
    if not live:
        return
    mode = key_mode(key)
    held = ", ".join(
        f"{r.supervisor_key}#{r.generation}"
        + ("" if r.expires_at is None else f" until {r.expires_at:%Y-%m-%d %H:%M:%S} UTC")
        for r in live[:5]
    )
    raise ModeConflictError(
        f"supervisor key {key!r} (mode {mode!r}) not claimed: a term of the other mode is live "
        f"({held}). Stop every replica of the old mode, then run `apsup maintenance "
        f"switch-mode --to {mode}`; or configure this replica with the mode the others run"
    )


def all_leases(conn: Connection) -> Iterator[LeaseRow]:
    rows = conn.execute(
        select(
            leases.c.supervisor_key,
            leases.c.holder_id,
            leases.c.supervisor_generation,
            leases.c.expires_at,
        ).order_by(leases.c.supervisor_key)
    )
    for r in rows:
        yield LeaseRow(r[0], r[1], int(r[2]), r[3])


def invalidate(
    conn: Connection, keys: Iterable[str] | None, expires_at: datetime | None
) -> list[str]:
    """Advance generation and clear the holder of the given (or all) keys; never resets."""
    stmt = update(leases).values(
        holder_id=INVALIDATED,
        supervisor_generation=leases.c.supervisor_generation + 1,
        expires_at=expires_at,
    )
    chosen = None if keys is None else sorted(set(keys))
    if chosen is not None:
        stmt = stmt.where(leases.c.supervisor_key.in_(chosen))
    conn.execute(stmt)
    return [
        r.supervisor_key for r in all_leases(conn) if chosen is None or r.supervisor_key in chosen
    ]


def take_lease(
    conn: Connection,
    key: str,
    holder_id: str,
    previous: LeaseRow | None,
    expires_at: datetime | None,
) -> Term:
    """Write a new term for ``key`` in the caller's (locked) transaction: generation 1 for a new
    row, else the previous generation + 1 — a takeover never reuses a generation (no ABA)."""
    if previous is None:
        conn.execute(
            insert(leases).values(
                supervisor_key=key,
                holder_id=holder_id,
                supervisor_generation=1,
                expires_at=expires_at,
            )
        )
        return Term(key, holder_id, 1)
    generation = previous.generation + 1
    conn.execute(
        update(leases)
        .where(leases.c.supervisor_key == key)
        .values(holder_id=holder_id, supervisor_generation=generation, expires_at=expires_at)
    )
    return Term(key, holder_id, generation)
