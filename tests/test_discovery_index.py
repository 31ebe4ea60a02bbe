"""Discovery is index-backed and bounded per page (DESIGN §3, RFC §4).

The exact statements ``intents.dirty_page`` and ``intents.request_page`` send (captured from
the cursor, with their parameters) are explained by the database itself: SQLite must SEARCH
``ix_intents_dirty`` / ``ix_intents_request`` with no table scan and no sort; OceanBase must do a
``TABLE RANGE SCAN`` of that index with the limit pushed down and no sort operator (on MySQL or
MariaDB: ``key`` is the index and ``Extra`` has no filesort). Pages honour their limit and walk
every pending key exactly once, in pending_sequence order, bounded by the scan's upper sequence.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, event, insert, update

from apsup.store import intents
from apsup.store.base import SqlBackend
from apsup.store.schema import PENDING_SEQUENCE_COUNTER, counters
from apsup.store.schema import intents as intents_table

pytestmark = [pytest.mark.timeout(120), pytest.mark.backends("sqlite", "mysql", "postgresql")]

TABLE = "pc_artifact_processing_intents"
BINDING = "target"
ROWS = 20_000
BINDINGS = ("before", BINDING, "zafter")  # neighbours on both sides of the target in the index


def _dirty(i: int) -> bool:
    return i % 7 == 0


def _requested(i: int) -> bool:
    return i % 11 == 0


@pytest.fixture
def populated(backend: SqlBackend) -> Iterator[SqlBackend]:
    """ROWS intents over three bindings; in each, every 7th dirty and every 11th requested."""
    rows = []
    for i in range(ROWS):
        rows.append(
            {
                "binding_name": BINDINGS[i % 3],
                "scope_id": f"scope-{i:06d}",
                "pending_sequence": i + 1,
                "dirty_generation": 2 if _dirty(i) else 1,
                "clean_generation": 1,
                "requested_generation": 3 if _requested(i) else 2,
                "handled_generation": 2,
            }
        )
    with backend.transaction() as conn:
        for start in range(0, ROWS, 2000):
            conn.execute(insert(intents_table), rows[start : start + 2000])
        conn.execute(
            update(counters).where(counters.c.name == PENDING_SEQUENCE_COUNTER).values(value=ROWS)
        )
    if backend.name == "sqlite":
        with backend.transaction() as conn:
            conn.exec_driver_sql("ANALYZE")  # the planner must pick the index with statistics too
    yield backend


def _expected(pred: Callable[[int], bool], upper: int = ROWS) -> list[int]:
    """pending_sequences of the target binding matching ``pred``, up to ``upper``."""
    return [i + 1 for i in range(ROWS) if BINDINGS[i % 3] == BINDING and pred(i) and i + 1 <= upper]


def _captured(backend: SqlBackend, call: Callable[[Connection], Any]) -> tuple[str, Any]:
    """The one statement ``call`` sends to the intents table, with its parameters."""
    seen: list[tuple[str, Any]] = []

    def listener(conn: Any, cursor: Any, statement: str, params: Any, ctx: Any, many: bool) -> None:
        if TABLE in statement:
            seen.append((statement, params))

    event.listen(backend.engine, "before_cursor_execute", listener)
    try:
        with backend.read() as conn:
            call(conn)
    finally:
        event.remove(backend.engine, "before_cursor_execute", listener)
    assert len(seen) == 1, seen
    return seen[0]


def _plan(backend: SqlBackend, statement: str, params: Any) -> list[str]:
    prefix = "EXPLAIN QUERY PLAN " if backend.name == "sqlite" else "EXPLAIN "
    with backend.read() as conn:
        result = conn.exec_driver_sql(prefix + statement, params)
        keys = list(result.keys())
        rows = result.fetchall()
    if backend.name == "sqlite":
        return [str(r[-1]) for r in rows]
    if "key" in keys:  # MySQL / MariaDB tabular EXPLAIN
        return [" ".join(f"{k}={v}" for k, v in zip(keys, r, strict=True)) for r in rows]
    return [str(r[0]) for r in rows]  # OceanBase: one text column


def _assert_index_plan(backend: SqlBackend, plan: list[str], index: str, flag: str) -> None:
    text = "\n".join(plan)
    if backend.name == "sqlite":
        assert any(
            line.startswith(f"SEARCH {TABLE} USING INDEX {index} (binding_name=? AND {flag}=?")
            for line in plan
        ), text
        assert f"SCAN {TABLE}" not in text, text
        assert "TEMP B-TREE" not in text, text  # order comes from the index, not a sort
    elif backend.name == "postgresql":
        # One index scan of the index, limit on top; no sequential scan, no sort.
        assert re.search(rf"Index (Only )?Scan using {index} on {TABLE}", text), text
        assert "Seq Scan" not in text and "Sort" not in text, text
        assert text.lstrip().startswith("Limit"), text
    elif "TABLE RANGE SCAN" in text or "TABLE FULL SCAN" in text or "range_cond" in text:
        # OceanBase: one range scan of the index, limit pushed down, no sort, no full scan.
        assert re.search(rf"\|\s*TABLE RANGE SCAN\s*\|\s*{TABLE}\({index}\)\s*\|", text), text
        assert "FULL SCAN" not in text, text
        assert "SORT" not in text, text
        assert "limit(" in text, text
        range_cond = text[text.index("range_cond(") :]
        assert f"{TABLE}.{flag} = 1" in range_cond, text  # the flag bounds the range: no filter
        assert "filter(nil)" in text, text
    else:
        line = plan[0]
        assert f"key={index}" in line, text
        assert "filesort" not in line.lower(), text
        assert "type=ALL" not in line, text


def test_dirty_page_uses_its_index(populated: SqlBackend) -> None:
    statement, params = _captured(
        populated, lambda conn: intents.dirty_page(conn, BINDING, 0, ROWS // 2, 100)
    )
    plan = _plan(populated, statement, params)
    _assert_index_plan(populated, plan, "ix_intents_dirty", "dirty_pending")


def test_request_page_uses_its_index(populated: SqlBackend) -> None:
    statement, params = _captured(
        populated, lambda conn: intents.request_page(conn, BINDING, 0, 100)
    )
    plan = _plan(populated, statement, params)
    _assert_index_plan(populated, plan, "ix_intents_request", "request_pending")


def test_dirty_pages_are_bounded_and_complete(populated: SqlBackend) -> None:
    upper = ROWS * 2 // 3
    expected = _expected(_dirty, upper)
    assert len(expected) > 500
    seen: list[int] = []
    after = 0
    with populated.read() as conn:
        while True:
            page = intents.dirty_page(conn, BINDING, after, upper, 100)
            assert len(page) <= 100
            if not page:
                break
            assert len(page) == 100 or len(seen) + len(page) == len(expected)
            seen.extend(seq for _, seq, _ in page)
            after = page[-1][1]
    assert seen == expected  # every dirty key once, in order, none above the upper bound


def test_request_pages_are_bounded_and_complete(populated: SqlBackend) -> None:
    expected = _expected(_requested)
    seen: list[int] = []
    after = 0
    with populated.read() as conn:
        assert intents.count_pending_requests(conn, BINDING) == len(expected)
        assert intents.count_dirty(conn, BINDING) == len(_expected(_dirty))
        while page := intents.request_page(conn, BINDING, after, 250):
            assert len(page) <= 250
            seen.extend(seq for _, seq in page)
            after = page[-1][1]
    assert seen == expected


def test_flag_columns_follow_the_generations(populated: SqlBackend) -> None:
    """The stored generated flags move with every update (no stale index entries)."""
    with populated.transaction() as conn:
        first = intents.dirty_page(conn, BINDING, 0, ROWS, 1)[0]
        scope, seq, _ = first
        assert intents.mark_clean(conn, BINDING, scope, 2, seq) is True
        assert intents.dirty_page(conn, BINDING, 0, ROWS, 1)[0][1] > seq
        intents.mark_dirty(conn, BINDING, scope)
        assert intents.dirty_page(conn, BINDING, 0, ROWS, 1)[0] == (scope, seq, 0)
        req_scope, req_seq = intents.request_page(conn, BINDING, 0, 1)[0]
        assert intents.acknowledge(conn, BINDING, req_scope, 3, req_seq) is True
        assert intents.request_page(conn, BINDING, 0, 1)[0][1] > req_seq
