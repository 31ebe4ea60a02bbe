"""Per-binding automatic check state and scan admission (RFC §4).

Every function here is a Supervisor control write or read: callers run writes through
``backend.run_fenced(term, ...)`` so the term is validated in the same transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, bindparam, insert, select, update

from apsup.store.schema import binding_states, intents

b = binding_states.c
i = intents.c


@dataclass(frozen=True)
class ScanState:
    binding_name: str
    checkpoint: datetime | None
    scan_generation: int
    scan_in_progress: bool
    scan_upper_pending_sequence: int | None


def get_state(conn: Connection, binding: str) -> ScanState | None:
    row = conn.execute(
        select(
            b.binding_name,
            b.last_schedule_checkpoint_at,
            b.scan_generation,
            b.scan_in_progress,
            b.scan_upper_pending_sequence,
        ).where(b.binding_name == binding)
    ).first()
    if row is None:
        return None
    upper = None if row[4] is None else int(row[4])
    return ScanState(row[0], row[1], int(row[2]), bool(row[3]), upper)


def ensure_state(conn: Connection, binding: str) -> ScanState:
    state = get_state(conn, binding)
    if state is None:
        conn.execute(insert(binding_states).values(binding_name=binding))
        state = get_state(conn, binding)
    assert state is not None
    return state


# The highest pending_sequence of a binding with a given dirty flag: the last entry of one range
# of ix_intents_dirty (binding_name, dirty_pending, pending_sequence), read backwards, one row.
_LAST_SEQUENCE = (
    select(i.pending_sequence)
    .where(i.binding_name == bindparam("p_binding"), i.dirty_pending == bindparam("p_flag"))
    .order_by(i.pending_sequence.desc())
    .limit(1)
)


def scan_upper_bound(conn: Connection, binding: str) -> int | None:
    """The binding's highest pending_sequence, in O(log n) whatever the binding's size.

    It is read while the write lock (SQLite) or the Lease row lock (MySQL) is held, so it must
    not range-scan the binding (its cost would grow with the binding while every writer waits).
    ``dirty_pending`` is 0 or 1, so the
    maximum is the larger of two index probes, one per flag value.
    """
    found = [
        conn.execute(_LAST_SEQUENCE, {"p_binding": binding, "p_flag": flag}).scalar()
        for flag in (0, 1)
    ]
    values = [int(v) for v in found if v is not None]
    return max(values) if values else None


def start_scan(
    conn: Connection, binding: str, checkpoint: datetime, rewound_from: datetime | None = None
) -> ScanState:
    """One transaction: scan_generation + 1, checkpoint, in-progress, upper pending_sequence.

    The checkpoint never moves backwards: an earlier one keeps the stored value (the returned
    state says which). The one exception is ``rewound_from``: a stored checkpoint at or before it
    was clamped by the scheduler after database time went back, and is replaced.
    """
    stored = ensure_state(conn, binding).checkpoint
    rewinding = rewound_from is not None and stored is not None and stored <= rewound_from
    if stored is not None and checkpoint <= stored and not rewinding:
        checkpoint = stored
    upper = scan_upper_bound(conn, binding)
    conn.execute(
        update(binding_states)
        .where(b.binding_name == binding)
        .values(
            scan_generation=b.scan_generation + 1,
            last_schedule_checkpoint_at=checkpoint,
            scan_in_progress=True,
            scan_upper_pending_sequence=upper,
        )
    )
    state = get_state(conn, binding)
    assert state is not None
    return state


def admit(conn: Connection, binding: str, scope_id: str, scan_generation: int) -> bool:
    """Durably admit a Scope for this scan; True if it now has an accepted request.

    Idempotent per scan: a Scope whose marker already equals this scan is not admitted again
    (crash recovery restarts pagination from the first page). An existing unacknowledged request
    is reused rather than duplicated, and the marker is still recorded.
    """
    row = conn.execute(
        select(
            i.requested_generation,
            i.handled_generation,
            i.last_auto_scan_generation,
            i.dirty_generation,
            i.clean_generation,
        )
        .where(i.binding_name == binding, i.scope_id == scope_id)
        .with_for_update()
    ).first()
    if row is None:
        return False
    requested, handled, last_auto, dirty, clean = (int(v) for v in row)
    if last_auto >= scan_generation or dirty <= clean:
        return requested > handled
    values: dict[str, object] = {"last_auto_scan_generation": scan_generation}
    if requested <= handled:
        values["requested_generation"] = i.requested_generation + 1
    conn.execute(
        update(intents).where(i.binding_name == binding, i.scope_id == scope_id).values(values)
    )
    return True


def end_scan(conn: Connection, binding: str, scan_generation: int) -> bool:
    return bool(
        conn.execute(
            update(binding_states)
            .where(b.binding_name == binding, b.scan_generation == scan_generation)
            .values(scan_in_progress=False)
        ).rowcount
    )


def set_checkpoint(conn: Connection, binding: str, checkpoint: datetime | None) -> None:
    """Used by migrations to carry a preserved check-time baseline."""
    ensure_state(conn, binding)
    conn.execute(
        update(binding_states)
        .where(b.binding_name == binding)
        .values(last_schedule_checkpoint_at=checkpoint)
    )
