"""Requests that arrive while a Scope is queued coalesce into the invocation that starts.

The host reads the rows of the keys its next dispatches will take ahead of time (with an
acknowledgment, or with another dispatch) and uses such a row for up to a second. A request
for a queued key announced in that second used to start the key with the older G and then
run a successor for the new one: two invocations where one, carrying the latest G, does. A
wake-up now drops the family's rows read ahead. Real host, real Workers, MySQL: the backend
that reads rows ahead with its acknowledgments (SQLite reads a row ahead only for a dispatch of
the same cycle, where no request can come in between).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from apsup.scheduling import KeyState
from apsup.store import open_backend
from apsup.supervisor import supervisor as supervisor_module
from tests.liveness_families import live_work
from tests.liveness_support import cycle_until, handled, live_host, request


@pytest.mark.backends("mysql")
def test_a_request_for_a_queued_scope_joins_the_invocation_that_starts(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A row read ahead stays usable for the whole test (not one second, which a loaded machine
    # can spend between two cycles): without the wake-up dropping it, count.x would start with
    # the older G every time, not only when the machine is fast.
    monkeypatch.setattr(supervisor_module, "READ_AHEAD_SECONDS", 600.0)
    with live_host(db_url, [live_work], tmp_path) as bundle:
        host, backend = bundle.host, bundle.backend
        sup = host.supervisors[0]
        holders = [f"noackwait.{i}" for i in range(live_work.max_workers)]
        for scope in holders:  # every Worker busy until its go file appears
            request(backend, live_work, scope)
        sup.notify(live_work.name)

        def running(scope: str) -> bool:
            core = sup.core
            return core is not None and core.key_state(live_work.name, scope) is KeyState.RUNNING

        cycle_until(host, lambda: all(running(s) for s in holders), 30, "all Workers busy")
        # first.* holds the slot it takes until its go file appears, so nothing but the go
        # of holders[1] below frees a slot for count.x (an "ok" Scope finished fast and, on a
        # loaded machine, let count.x start with G1 before this test could look).
        request(backend, live_work, "noackwait.first")
        g1 = request(backend, live_work, "count.x")
        sup.notify(live_work.name)
        cycle_until(
            host,
            lambda: (
                sup.core is not None
                and sup.core.key_state(live_work.name, "count.x") is KeyState.READY
            ),
            10,
            "both queued",
        )
        t0 = time.monotonic()  # the wake-ups of these requests are all taken in first
        while time.monotonic() - t0 < 0.5:
            host.cycle(max_wait=0.05)
        # One slot frees: its acknowledgment reads ahead the rows of noackwait.first and
        # count.x, noackwait.first starts, count.x stays queued with its row read.
        (tmp_path / f"go.{holders[0]}").touch()
        cycle_until(host, lambda: running("noackwait.first"), 10, "noackwait.first started")
        key = (live_work.binding_name, "count.x")
        # (with that acknowledgment, which may come a cycle after the dispatch)
        cycle_until(host, lambda: key in sup._rows, 10, "count.x's row read ahead")
        read_at = sup._rows[key][1]
        app = open_backend(db_url)
        try:
            with app.transaction() as conn:
                g2 = live_work.request(conn, "count.x")
        finally:
            app.dispose()
        sup.notify(live_work.name)  # its wake-up
        (tmp_path / f"go.{holders[1]}").touch()
        cycle_until(
            host,
            lambda: running("count.x") or handled(backend, live_work, "count.x", g2),
            10,
            "count.x started",
        )
        started_after = time.monotonic() - read_at
        cycle_until(host, lambda: handled(backend, live_work, "count.x", g2), 30, "G2 handled")
        for scope in [*holders[2:], "noackwait.first"]:
            (tmp_path / f"go.{scope}").touch()
        cycle_until(host, lambda: not sup.running, 30, "Workers done")
    starts = (tmp_path / "starts.count.x").read_text().split()
    print(f"\ncount.x started {started_after:.2f} s after its row was read; ran with G {starts}")
    assert g2 == g1 + 1
    assert starts == [str(g2)], starts  # one invocation, with the latest G
