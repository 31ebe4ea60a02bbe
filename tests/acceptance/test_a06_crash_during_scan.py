"""RFC acceptance 6: a crash (kill -9 of the host) after a scan started, after an automatic
admission committed but before the Scope reached the in-memory queue, or in the middle of
pagination loses no request and never admits a Scope twice in the same scan. Continuous
registration of new Scopes still lets a scan finish.

The host runs as a subprocess (``host_runner``) that SIGKILLs itself at the chosen point (right
after the scan-start or the N-th admission transaction committed). The ``keep`` processor
acknowledges without marking clean, so every Scope stays dirty: only the scan's
last-auto-scan marker can stop a restarted scan from admitting an already handled Scope again.
The interval is long, so the only automatic scan in the test is the first one.

A Worker orphaned by the kill keeps running; the restarted host's new term fences its commits.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from tests.acceptance.families import configure
from tests.acceptance.harness import (
    all_intents,
    events,
    handled,
    intent,
    pid_alive,
    request,
    scan_state,
    scope_events,
    set_flag,
    wait_for,
    write,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.backends("sqlite")]

SCOPES = 12
PAGE = 5
SPEC = {"acc-a": {"interval": 60, "max_workers": 3}}


@pytest.mark.parametrize(
    ("crash", "admitted_before_crash"),
    [
        ({"kill_after_scan_start": True}, 0),
        ({"kill_after_admissions": 1}, 1),
        ({"kill_after_admissions": 7}, 7),  # on the second page
    ],
    ids=["after-scan-start", "after-first-admission", "mid-pagination"],
)
def test_kill_9_during_a_scan_loses_nothing_and_admits_once(
    hosts, store, crash, admitted_before_crash
):
    fam = configure("acc-a", **SPEC["acc-a"])
    scopes = [f"keep.{i:02d}" for i in range(SCOPES)]
    write(store, lambda c: [fam.mark_dirty(c, s) for s in scopes])

    first = hosts.process(SPEC, page_size=PAGE, **crash)
    assert first.wait() == -signal.SIGKILL, first.errors()[-2000:]

    st = scan_state(store, fam)
    assert (st.scan_generation, st.scan_in_progress) == (1, True)
    assert st.checkpoint is not None  # the checkpoint advanced with the scan start
    rows = all_intents(store, fam)
    admitted = sorted(s for s, r in rows.items() if r.last_auto_scan_generation == 1)
    # Admissions are in pending-sequence order and durable before the in-memory queue.
    assert admitted == scopes[:admitted_before_crash]
    assert all(rows[s].requested_generation == 1 for s in admitted)

    second = hosts.process(SPEC, page_size=PAGE)
    second.wait_ready()
    wait_for(
        lambda: all(
            r.requested_generation == r.handled_generation == 1
            for r in all_intents(store, fam).values()
        ),
        "every Scope admitted once and handled after the restart",
    )
    wait_for(lambda: not scan_state(store, fam).scan_in_progress, "the resumed scan ends")

    st = scan_state(store, fam)
    assert st.scan_generation == 1, "the restart resumed the unfinished scan, not a new one"
    rows = all_intents(store, fam)
    assert set(rows) == set(scopes)
    for scope, row in rows.items():
        assert row.last_auto_scan_generation == 1, scope
        assert (row.requested_generation, row.handled_generation) == (1, 1), scope
        assert row.dirty_generation > row.clean_generation  # still dirty: the marker decided
    ok = [e for e in events(store, fam) if e["outcome"] == "ok"]
    assert {e["scope_id"] for e in ok} == set(scopes)
    assert {e["generation"] for e in events(store, fam)} == {1}

    second.signal(signal.SIGTERM)
    assert second.wait() == 0, second.errors()[-2000:]


def test_continuous_registration_still_lets_a_scan_finish(hosts, store):
    fam = configure("acc-a", interval=60, max_workers=3)
    write(store, lambda c: [fam.mark_dirty(c, f"keep.{i:03d}") for i in range(20)])
    stop = threading.Event()
    registered = {"n": 0}

    def register() -> None:
        while not stop.is_set():
            write(store, lambda c: fam.mark_dirty(c, f"keep.n{registered['n']:04d}"))
            registered["n"] += 1
            stop.wait(0.005)

    host = hosts.live_host([fam], page_size=PAGE)
    producer = threading.Thread(target=register, daemon=True)
    producer.start()
    try:
        host.run_until(
            lambda: (
                (st := scan_state(store, fam)) is not None
                and st.scan_generation == 1
                and not st.scan_in_progress
            ),
            "the first scan ends while new Scopes keep arriving",
        )
    finally:
        stop.set()
        producer.join(10)
    assert registered["n"] > 0
    upper = scan_state(store, fam).scan_upper_pending_sequence
    rows = all_intents(store, fam)
    inside = {s for s, r in rows.items() if r.pending_sequence <= upper}
    assert len(inside) >= 20
    assert len(rows) > len(inside), "no Scope was registered while the scan ran"
    for scope, row in rows.items():
        # The scan's membership was fixed at its start; later Scopes wait for the next check.
        expected = 1 if scope in inside else 0
        assert row.last_auto_scan_generation == expected, (scope, row)


def test_orphaned_worker_of_a_killed_host_cannot_commit(hosts, store):
    """kill -9 of the host leaves its Worker running; the restarted host's new term runs the
    Scope again, and the orphan's acknowledgment (fenced by the old term) never commits."""
    spec = {"acc-manual": {"disabled": True, "max_workers": 2}}
    fam = configure("acc-manual", **spec["acc-manual"])
    request(store, fam, "gate.o", tell=False)
    first = hosts.process(spec)
    wait_for(lambda: scope_events(store, fam, "gate.o"), "the first host's Worker starts")
    (orphan,) = scope_events(store, fam, "gate.o")
    try:
        first.signal(signal.SIGKILL)
        assert first.wait() == -signal.SIGKILL
        assert pid_alive(orphan["pid"]), "the Worker should survive its host"

        second = hosts.process(spec)
        second.wait_ready()
        wait_for(lambda: len(scope_events(store, fam, "gate.o")) == 2, "the new term runs it again")
        set_flag(store, "gate:gate.o")  # both Workers now try to acknowledge
        wait_for(lambda: handled(store, fam, "gate.o"), "the new Worker acknowledges")
        wait_for(lambda: not pid_alive(orphan["pid"]), "the orphan exits")
    finally:
        if pid_alive(orphan["pid"]):
            os.kill(orphan["pid"], signal.SIGKILL)
    old, new = scope_events(store, fam, "gate.o")
    assert new["term"] > old["term"]
    assert (old["ended_us"], old["outcome"]) == (None, None), "an old-term commit went through"
    assert new["outcome"] == "ok"
    row = intent(store, fam, "gate.o")
    assert (row.requested_generation, row.handled_generation) == (1, 1)
    second.signal(signal.SIGTERM)
    assert second.wait() == 0
