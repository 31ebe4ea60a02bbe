"""An operator's action is consumed exactly: the leader clears only the requests it read and
acted on (both backends, a real host, a real racing operator transaction).

The leader reads a Scope's pending retry, and before it clears that request an operator commits
a stop of the same Scope: the stop survives the retry's clearing, the leader reads it at its
next poll (the action advanced the family's control version), and the running Worker gets
SIGTERM. Clearing both flags unconditionally lost the stop: the Scope showed parked while its
Worker ran on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection

from apsup import operator
from apsup.store import migrate, open_backend, operator_state
from tests import liveness_families as lf
from tests.liveness_support import cycle_until, live_host, request

pytestmark = [pytest.mark.timeout(120), pytest.mark.backends("sqlite", "mysql", "postgresql")]


def test_a_stop_committed_while_the_leader_acts_on_a_retry_is_not_lost(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    operator_side = open_backend(db_url)
    fam = lf.live_work
    scope = "failslow.race"  # failing (its first attempt failed), then running
    read_held = operator_state.held
    raced: list[str] = []

    def held_then_a_stop_commits(conn: Connection, binding: str) -> Any:
        rows = read_held(conn, binding)
        if not raced and any(s.scope_id == scope and s.retry_requested for s in rows):
            with operator_side.transaction() as other:  # the operator, racing the leader
                raced.append(operator.stop(other, fam, scope))
        return rows

    try:
        request(backend, fam, scope)
        with live_host(db_url, [fam], tmp_path) as b:
            sup = b.host.supervisors[0]
            cycle_until(b.host, (tmp_path / f"second.{scope}").exists, 30, "its retry running")
            monkeypatch.setattr(operator_state, "held", held_then_a_stop_commits)
            with backend.transaction() as conn:
                operator.retry(conn, fam, scope)
            cycle_until(b.host, lambda: raced, 30, "the leader read the retry")
            cycle_until(b.host, lambda: not sup.running, 30, "the stop reached the Worker")
            assert sup.completed[fam.name] == 0
        with backend.read() as conn:
            state = operator_state.scope_state(conn, fam.binding_name, scope)
        assert state is not None and state.parked
        assert not state.stop_requested and not state.retry_requested  # both consumed
    finally:
        operator_side.dispose()
        backend.dispose()
