"""In-memory model of the durable store (RFC §3, §4, §8) with the same semantics as the real one.

It holds exactly what survives a crash: intents (dirty/clean, requested/handled,
last_auto_scan_generation, pending_sequence), binding check state, the lease term, and a toy
ordered processor per Scope (an input journal B1, B2, ... and a business cursor). Every control
and business write is fenced by the term, like the real fenced transactions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from apsup.scheduling import RequestRow, ScanRow


class StaleTerm(Exception):
    """A fenced write carried an old term; nothing was written."""


class CursorConflict(Exception):
    """The processor's progress CAS failed (someone else moved the cursor)."""


@dataclass
class Intent:
    pending_sequence: int
    dirty: int = 0
    clean: int = 0
    requested: int = 0
    handled: int = 0
    last_auto: int = 0
    # toy ordered processor: inputs 1..journal exist, 1..cursor are consumed
    journal: int = 0
    cursor: int = 0
    consumed: list[int] = field(default_factory=list)


@dataclass
class Binding:
    checkpoint: datetime | None = None
    scan_generation: int = 0
    scan_in_progress: bool = False
    upper: int | None = None


class ModelStore:
    def __init__(self, families: list[str]) -> None:
        self.term = 0
        self.intents: dict[str, dict[str, Intent]] = {f: {} for f in families}
        self.bindings = {f: Binding() for f in families}
        self._sequence = 0
        # (family, scope, scan generation) that automatic admission has marked: at most once
        self.auto_admitted: set[tuple[str, str, int]] = set()
        # scopes with requested > handled, kept up to date so checks need not scan every row
        self.open_requests: dict[str, set[str]] = {f: set() for f in families}
        #: (family, scope) -> (next attempt, failed at) the shell recorded at its last failure
        #: (the failure state table); removed at a success, kept across terms like the row.
        self.backoff_until: dict[tuple[str, str], tuple[datetime, datetime]] = {}

    # --- domain side (no term: APIs need not be leaders) -----------------------------------------

    def intent(self, family: str, scope: str) -> Intent:
        rows = self.intents[family]
        if scope not in rows:
            self._sequence += 1  # assigned on first registration, never reused
            rows[scope] = Intent(self._sequence)
        return rows[scope]

    def mark_dirty(self, family: str, scope: str) -> None:
        """Publish one input and its dirty marker in one transaction."""
        row = self.intent(family, scope)
        row.journal += 1
        row.dirty += 1

    def request(self, family: str, scope: str, with_input: bool) -> int:
        row = self.intent(family, scope)
        if with_input:
            row.journal += 1
            row.dirty += 1
        row.requested += 1
        self.open_requests[family].add(scope)
        return row.requested

    # --- scheduling control (fenced) -------------------------------------------------------------

    def fence(self, term: int) -> None:
        if term != self.term:
            raise StaleTerm(f"term {term} is stale (current {self.term})")

    def start_scan(self, term: int, family: str, checkpoint: datetime) -> tuple[int, int | None]:
        self.fence(term)
        b = self.bindings[family]
        b.scan_generation += 1
        b.checkpoint = checkpoint
        b.scan_in_progress = True
        rows = self.intents[family]
        b.upper = max((r.pending_sequence for r in rows.values()), default=None)
        return b.scan_generation, b.upper

    def scan_page(
        self, family: str, after: int, upper: int, limit: int
    ) -> tuple[list[ScanRow], bool]:
        matching = [
            ScanRow(scope, r.pending_sequence, r.last_auto)
            for scope, r in self.intents[family].items()  # insertion order == sequence order
            if r.dirty > r.clean and after < r.pending_sequence <= upper
        ]
        return matching[:limit], len(matching) <= limit

    def admit(self, term: int, family: str, scope: str, generation: int) -> bool:
        self.fence(term)
        row = self.intents[family][scope]
        if row.last_auto >= generation:
            return row.requested > row.handled
        marker = (family, scope, generation)
        assert marker not in self.auto_admitted, f"store admitted {marker} twice"
        self.auto_admitted.add(marker)
        row.last_auto = generation
        if row.requested <= row.handled:
            row.requested += 1  # otherwise reuse the unacknowledged request
            self.open_requests[family].add(scope)
        return True

    def end_scan(self, term: int, family: str, generation: int) -> None:
        self.fence(term)
        b = self.bindings[family]
        if b.scan_generation == generation:
            b.scan_in_progress = False

    def request_page(
        self,
        family: str,
        after: int,
        limit: int,
        backoff_at: datetime | None = None,
        failed_after: datetime | None = None,
    ) -> tuple[list[RequestRow], bool]:
        """``backoff_at``/``failed_after``: leave out Scopes whose recorded next attempt is
        later, for a failure recorded after ``failed_after`` (the shell's failure state,
        ``backoff_until``), as the real page does."""

        def hidden(scope: str) -> bool:
            if backoff_at is None or failed_after is None:
                return False
            until, failed_at = self.backoff_until.get((family, scope), (None, None))
            return until is not None and until > backoff_at and failed_at > failed_after

        matching = [
            RequestRow(scope, r.pending_sequence)
            for scope, r in self.intents[family].items()
            if r.requested > r.handled and r.pending_sequence > after and not hidden(scope)
        ]
        return matching[:limit], len(matching) <= limit

    def claim(self, family: str, scope: str) -> int | None:
        """Dispatch reads the latest requested generation G; None if G is already handled."""
        row = self.intents[family][scope]
        return row.requested if row.handled < row.requested else None

    # --- Worker side (fenced business commit) ----------------------------------------------------

    def commit(
        self,
        term: int,
        family: str,
        scope: str,
        *,
        expected_cursor: int,
        consume: int,
        snapshot_journal: int,
        snapshot_dirty: int,
        ack: int | None,
    ) -> None:
        """One short processor transaction: consume inputs in order, maybe mark clean and ack."""
        self.fence(term)
        row = self.intents[family][scope]
        if row.cursor != expected_cursor:
            raise CursorConflict(f"{family}/{scope}: cursor {row.cursor} != {expected_cursor}")
        for item in range(row.cursor + 1, row.cursor + consume + 1):
            row.consumed.append(item)
        row.cursor += consume
        if row.cursor >= snapshot_journal:
            # no work remains in the snapshot read at start: acknowledge only that dirty version
            assert snapshot_dirty <= row.dirty
            row.clean = max(row.clean, snapshot_dirty)
        if ack is not None:
            assert ack <= row.requested, f"ack G={ack} above requested {row.requested}"
            row.handled = max(row.handled, ack)
            if row.handled >= row.requested:
                self.open_requests[family].discard(scope)
