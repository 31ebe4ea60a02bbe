"""RFC acceptance 9: lost notifications, Worker crashes, timeouts, exit 0 without an
acknowledgment and failures after partial business commits all recover from durable facts; a
duplicate invocation for an already acknowledged G consumes no new input.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from apsup.context import ExecutionContext
from tests.acceptance.families import add_inputs, configure, input_rows
from tests.acceptance.harness import (
    REPO_ROOT,
    handled,
    intent,
    pid_alive,
    request,
    scope_events,
    write,
)

pytestmark = pytest.mark.timeout(180)

# Scenarios marked with this run once with the sync test family and once with its async def twin.
flavours = pytest.mark.parametrize("suffix", ["", "-async"], ids=["sync", "async"])


def _idle(host, fam) -> bool:
    snap = host.snapshot()[fam.name]
    return snap.step_in_flight is None and not snap.request_pass_active and snap.running == 0


def test_lost_notification_recovers_at_the_next_check(hosts, store):
    fam = configure("acc-a", interval=0.5, max_workers=2)
    host = hosts.live_host([fam])
    host.run_until(lambda: _idle(host, fam), "the host is idle")
    request(store, fam, "ok.lost", tell=False)  # committed; the notification is lost
    host.run_until(lambda: handled(store, fam, "ok.lost"), "the next check finds the request")
    (event,) = scope_events(store, fam, "ok.lost")
    assert event["generation"] == 1 and event["last_scan"] == 0  # a request, not an admission


def test_lost_notification_recovers_without_a_restart_and_at_restart(hosts, store):
    """Automatic admission disabled: a lost wake-up is found by the running host (SQLite: its
    file watch; MySQL: its request poll), and intent accepted while no host runs is found by
    the next start."""
    fam = configure("acc-manual", disabled=True, max_workers=2)
    host = hosts.live_host([fam])
    host.run_until(lambda: _idle(host, fam), "the host is idle")
    request(store, fam, "ok.lost", tell=False)
    host.run_until(lambda: handled(store, fam, "ok.lost"), "the running host finds it")
    host.close()

    request(store, fam, "ok.down")  # nobody listens: the wake-up reaches no host
    restarted = hosts.live_host([fam])
    restarted.run_until(lambda: handled(store, fam, "ok.down"), "the restart recovers it")


@pytest.mark.backends("sqlite")
@flavours
def test_crashed_workers_are_retried(hosts, store, suffix):
    fam = configure(f"acc-manual{suffix}", disabled=True, max_workers=2)
    host = hosts.live_host([fam])
    request(store, fam, "crash.k")  # SIGKILLs itself on its first attempt
    request(store, fam, "exit1.e")  # os._exit(1) on its first attempt
    host.run_until(
        lambda: handled(store, fam, "crash.k") and handled(store, fam, "exit1.e"),
        "both Scopes succeed on retry",
    )
    for scope, first in (("crash.k", "crash"), ("exit1.e", "exit1")):
        evs = scope_events(store, fam, scope)
        assert [e["outcome"] for e in evs] == [first, "ok"], evs
        assert evs[0]["ended_us"] is None and not pid_alive(evs[0]["pid"])
        assert {e["generation"] for e in evs} == {1}  # the same unacknowledged request
    assert host.supervisor.failed[fam.name] == 2


@pytest.mark.backends("sqlite")
@flavours
def test_timed_out_workers_are_stopped_then_retried_after_confirmed_exit(hosts, store, suffix):
    """Budget 1: capacity is released only once a timed-out Worker's exit is confirmed, so no
    invocation of this family ever starts while another of its Workers is alive."""
    fam = configure(f"acc-b{suffix}", disabled=True, max_workers=1, timeout=1.0)
    host = hosts.live_host([fam], grace_seconds=0.5)
    request(store, fam, "hang.h")  # ignores SIGTERM: needs the SIGKILL after the grace period
    request(store, fam, "soft.s")  # stops on SIGTERM
    request(store, fam, "ok.o")
    host.run_until(
        lambda: all(handled(store, fam, s) for s in ("hang.h", "soft.s", "ok.o")),
        "every Scope succeeds, the timed-out ones on retry",
    )
    for scope, first in (("hang.h", "hang"), ("soft.s", "soft")):
        evs = scope_events(store, fam, scope)
        assert [e["outcome"] for e in evs] == [first, "ok"], evs
        assert not pid_alive(evs[0]["pid"])
    all_events = scope_events(store, fam, "hang.h") + scope_events(store, fam, "soft.s")
    all_events += scope_events(store, fam, "ok.o")
    assert [e["alive_peers"] for e in all_events] == [0] * len(all_events), (
        "a Worker started while a timed-out one of the same budget was still alive"
    )
    assert host.supervisor.failed[fam.name] == 2


@flavours
def test_exit_zero_without_acknowledgment_is_a_failure(hosts, store, suffix):
    fam = configure(f"acc-manual{suffix}", disabled=True, max_workers=1)
    host = hosts.live_host([fam])
    request(store, fam, "noack.n")
    host.run_until(lambda: handled(store, fam, "noack.n"), "the retry acknowledges")
    evs = scope_events(store, fam, "noack.n")
    assert [e["outcome"] for e in evs] == ["noack", "ok"]
    assert [e["generation"] for e in evs] == [1, 1]  # the request was not discarded
    assert host.supervisor.failed[fam.name] == 1


@pytest.mark.backends("sqlite")
def test_failure_after_partial_commits_resumes_from_business_progress(hosts, store):
    fam = configure("acc-manual", disabled=True, max_workers=1)
    write(store, lambda c: add_inputs(c, fam, "partfail.p", ["i1", "i2", "i3"]))
    host = hosts.live_host([fam])
    request(store, fam, "partfail.p")
    host.run_until(lambda: handled(store, fam, "partfail.p"), "the retry completes")
    with store.read() as conn:
        rows = input_rows(conn, fam.name, "partfail.p")
    # i1 was committed by the failed attempt and not replayed (a double consume would fail).
    assert [r["consumed_generation"] for r in rows] == [1, 1, 1]
    evs = scope_events(store, fam, "partfail.p")
    assert [e["outcome"] for e in evs] == ["partfail", "ok"]
    consumed_at = [r["consumed_us"] for r in rows]
    assert consumed_at[0] < evs[1]["started_us"] < consumed_at[1]


def test_duplicate_invocation_of_an_acknowledged_generation_consumes_nothing(hosts, store):
    fam = configure("acc-manual", disabled=True, max_workers=1)
    write(store, lambda c: add_inputs(c, fam, "ackcrash.d", ["i1"]))
    host = hosts.live_host([fam])
    request(store, fam, "ackcrash.d")  # consumes i1 + acknowledges G=1, then exits 1
    host.run_until(
        lambda: scope_events(store, fam, "ackcrash.d") and host.supervisor.failed[fam.name] == 1,
        "the Worker acknowledged, then its exit was a failure",
    )
    write(store, lambda c: add_inputs(c, fam, "ackcrash.d", ["i2"]))  # new input, no request
    # The failure is retried after backoff: dispatch finds handled >= G and launches nothing.
    host.run_until(
        lambda: host.supervisor.core.key_state(fam.name, "ackcrash.d") is None,
        "the retry of the acknowledged G completes without a Worker",
    )
    assert len(scope_events(store, fam, "ackcrash.d")) == 1

    # A duplicate Worker for G=1 anyway (as after lost transport): the real wrapper, in a real
    # process, acknowledges it as complete without calling the processor.
    term = host.supervisor.term
    row = intent(store, fam, "ackcrash.d")
    ctx = ExecutionContext(
        binding_name=fam.binding_name,
        artifact_family=fam.name,
        scope_id="ackcrash.d",
        claimed_request_generation=1,
        supervisor_key=term.supervisor_key,
        holder_id=term.holder_id,
        supervisor_generation=term.generation,
        worker_id="duplicate",
        pending_sequence=row.pending_sequence,
        entry_point=fam.entry_point,
        database_url=store.url,
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from apsup.workers.invoke import run; "
            "sys.exit(run(sys.stdin.buffer.read()))",
        ],
        input=ctx.to_bytes(),
        capture_output=True,
        cwd=REPO_ROOT,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert len(scope_events(store, fam, "ackcrash.d")) == 1, "the processor ran again"
    with store.read() as conn:
        rows = input_rows(conn, fam.name, "ackcrash.d")
    assert [(r["payload"], r["consumed_generation"]) for r in rows] == [("i1", 1), ("i2", None)]
    row = intent(store, fam, "ackcrash.d")
    assert (row.requested_generation, row.handled_generation) == (1, 1)
    assert row.dirty_generation > row.clean_generation  # i2 waits for a new request


def test_crash_between_input_reference_and_intent_publication_leaves_no_hidden_work(hosts, store):
    """Domain input and its dirty marker commit in one transaction: a process killed before the
    commit leaves neither; one that commits leaves both, and a check discovers it."""
    fam = configure("acc-a", interval=0.5, max_workers=1)
    code = (
        "import os, sys\n"
        "from apsup.store import open_backend\n"
        "from tests.acceptance.families import add_inputs, configure\n"
        "fam = configure('acc-a')\n"
        "backend = open_backend(sys.argv[1])\n"
        "with backend.transaction() as conn:\n"
        "    add_inputs(conn, fam, sys.argv[2], ['x'])\n"
        "    if sys.argv[3] == 'crash':\n"
        "        os._exit(9)  # input referenced and marker written, nothing committed\n"
    )
    for scope, mode, expected in (("ok.crashed", "crash", 9), ("ok.committed", "commit", 0)):
        done = subprocess.run(
            [sys.executable, "-c", code, store.url, scope, mode],
            capture_output=True,
            cwd=REPO_ROOT,
            timeout=60,
            check=False,
        )
        assert done.returncode == expected, done.stderr
    with store.read() as conn:
        assert input_rows(conn, fam.name, "ok.crashed") == []
        assert len(input_rows(conn, fam.name, "ok.committed")) == 1
    assert intent(store, fam, "ok.crashed") is None

    host = hosts.live_host([fam])
    host.run_until(
        lambda: intent(store, fam, "ok.committed").clean_generation == 1,
        "a check discovers and processes the committed input",
    )
    assert scope_events(store, fam, "ok.crashed") == []
