"""Maintenance procedures run with every host stopped (RFC §9).

``switch_mode(settings, to)`` is step 2 of the coordinated mode change: it invalidates *every*
active term in the database, of both modes (``global`` and every ``artifact:<family>``), in one
transaction. Invalidation clears the holder and advances the generation (never resets it), so a
Worker of the old mode that is still alive somewhere cannot commit (its fenced transaction fails
with ``StaleTermError``), and an old permanent SQLite term does not stay valid merely because a
new key appears. Intents (request/dirty counters), scan state, check times and processor
progress are not touched: the new mode recovers from them.

Preconditions it enforces:

- SQLite: no host may be running. The host lock is taken for the duration of the switch, so a
  running host makes it fail (``HostConflictError``) and no host can start meanwhile.
- MySQL/OceanBase: no replica may still hold a live Lease (a stopped replica releases its term;
  a killed one's Lease expires after the lease time). A live Lease makes it fail with a message
  naming the key and when it expires; ``force=True`` skips that check (e.g. when a replica is
  known dead but its Lease has not expired yet). Standby candidates hold no Lease and cannot be
  detected: the operator must stop them first (step 1), as the procedure says.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from apsup.errors import ConfigError, HostConflictError
from apsup.store import backend_kind, open_backend
from apsup.store.leases import GLOBAL_KEY, INVALIDATED, LeaseRow
from apsup.supervisor.launcher import MODES

if TYPE_CHECKING:
    from apsup.config import Settings


@dataclass(frozen=True)
class KeyChange:
    key: str
    holder_before: str
    generation_before: int
    generation_after: int

    @property
    def was_active(self) -> bool:
        return self.holder_before != INVALIDATED


@dataclass(frozen=True)
class SwitchReport:
    """What ``switch_mode`` did; ``str()`` is the operator-facing summary the CLI prints."""

    to: str
    database: str
    backend: str
    changes: tuple[KeyChange, ...]
    configured_mode: str
    prefix: str
    new_keys: tuple[str, ...]

    def __str__(self) -> str:
        lines = [f"switch-mode to {self.to!r} on {self.database} ({self.backend})"]
        if not self.changes:
            lines.append("  no Lease rows yet: nothing to invalidate")
        for c in self.changes:
            state = "active" if c.was_active else "already invalid"
            lines.append(
                f"  invalidated {c.key}: generation {c.generation_before} -> "
                f"{c.generation_after} ({state} before)"
            )
        lines.append(
            "  intents, scan state, check times and processor progress were left untouched"
        )
        lines.append(f"  keys of mode {self.to!r}: {', '.join(self.new_keys)}")
        if self.configured_mode != self.to:
            lines.append(
                f"  NOTE: this configuration still says mode {self.configured_mode!r}: set "
                f"{self.prefix}ARTIFACT_PROCESSING_SUPERVISOR_MODE={self.to} on every replica"
            )
        lines.append(
            "next: give every replica the same mode, registry and family configuration, "
            "then start them and leave maintenance (RFC §9 step 3)"
        )
        return "\n".join(lines)


def _new_keys(settings: Settings, to: str) -> tuple[str, ...]:
    if to == "global":
        return (GLOBAL_KEY,)
    return tuple(settings.families[n].supervisor_key for n in sorted(settings.families))


def _live(rows: list[LeaseRow], now: datetime) -> list[LeaseRow]:
    return [
        r
        for r in rows
        if r.holder_id != INVALIDATED and r.expires_at is not None and r.expires_at > now
    ]


def switch_mode(settings: Settings, to: str, *, force: bool = False) -> SwitchReport:
    """Invalidate every active term (both modes' keys), advancing generations; see module doc."""
    if to not in MODES:
        raise ConfigError(f"unknown mode {to!r}: use 'global' or 'dedicated'")
    url = settings.database_url
    kind = backend_kind(url)
    lock = None
    if kind == "sqlite":
        from apsup.supervisor.control import HostLock

        lock = HostLock(url)
        try:
            lock.acquire()
        except HostConflictError as exc:
            raise HostConflictError(
                f"{exc}. Stop every apsup host on this database before switch-mode "
                "(RFC §9: coordinated shutdown)"
            ) from None
    backend = open_backend(url)
    try:
        before = {r.supervisor_key: r for r in backend.lease_rows()}
        if kind != "sqlite" and not force:
            live = _live(list(before.values()), backend.now())
            if live:
                now = backend.now()
                detail = ", ".join(
                    f"{r.supervisor_key} (generation {r.generation}, expires in "
                    f"{max(0.0, (r.expires_at - now).total_seconds()):.1f}s)"
                    for r in live
                    if r.expires_at is not None
                )
                raise HostConflictError(
                    f"replicas still hold live Leases: {detail}. Stop every background "
                    "replica first (RFC §9 step 1); a killed replica's Lease expires after the "
                    "lease time. Retry then, or pass --force (force=True) if the holders are "
                    "known to be dead"
                )
        backend.invalidate_terms(None)
        after = {r.supervisor_key: r for r in backend.lease_rows()}
    finally:
        backend.dispose()
        if lock is not None:
            lock.release()
    changes = tuple(
        KeyChange(
            key,
            before[key].holder_id,
            before[key].generation,
            after[key].generation if key in after else before[key].generation,
        )
        for key in sorted(before)
    )
    return SwitchReport(
        to=to,
        database=backend.describe(),
        backend=kind,
        changes=changes,
        configured_mode=settings.mode,
        prefix=settings.prefix,
        new_keys=_new_keys(settings, to),
    )


__all__ = ["KeyChange", "SwitchReport", "switch_mode"]
