"""Operator truth and actions: every failure says why, failing Scopes are listed, and an
operator acts with one command, durably, on whichever replica leads (both backends).

- a failing Scope's state (consecutive failures, last error type and *redacted* message, when,
  next attempt) is stored, shown in ``/status`` and by ``apsup status --db --json``; a URL
  password and a ``secret=`` pair in the message never appear anywhere;
- ``retry`` makes a Scope waiting for a 30 s backoff run within one poll;
- ``park`` holds a Scope across a restart (a new term: a leadership change), its request kept;
  ``unpark`` runs it;
- ``stop`` ends the running invocation (SIGTERM), counts no failure (no backoff) and
  parks the Scope;
- ``pause`` starts nothing new (a request waits), ``resume`` runs it; the pause survives a
  restart too;
- the CLI prints what it changed and exits 2 for an unknown family or Scope.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy import Connection

from apsup import operator
from apsup.observability.health import Heartbeat
from apsup.observability.metrics import SupervisorMetrics
from apsup.registry import Family
from apsup.store import SqlBackend, operator_state
from apsup.supervisor.runtime import HostObserver
from tests.acceptance.families import configure
from tests.acceptance.harness import LiveHost, completed, handled, request, scope_events, write

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
SLOW_BACKOFF = (30.0, 60.0)  # far longer than any wait below: only an action shortens it


def _act(store: SqlBackend, fn: Any, fam: Family, *args: str) -> str:
    def body(conn: Connection) -> str:
        return str(fn(conn, fam, *args))

    return str(write(store, body))


def _state(store: SqlBackend, fam: Family, scope: str) -> operator_state.ScopeState | None:
    with store.read() as conn:
        return operator_state.scope_state(conn, fam.binding_name, scope)


def _observe(host: LiveHost) -> dict[str, Any]:
    observer = HostObserver(
        role="all",
        mode="global",
        metrics=SupervisorMetrics(families=list(host.supervisor.families)),
        heartbeat=Heartbeat(),
        lease_read_seconds=1,
    )
    observer(host.host)
    return dict(observer.status())


def _cli(store: SqlBackend, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POWERCONTEXT_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "apsup.cli", *args, "--db", store.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=str(REPO),
    )


@pytest.fixture
def relay() -> Any:
    """The Worker log relay ``apsup run`` uses: how a Worker tells the host why it failed."""
    from apsup.observability.worker_logs import WorkerLogRelay

    r = WorkerLogRelay()
    try:
        yield r
    finally:
        r.close()


def test_every_failure_says_why_redacted_stored_and_listed(hosts, store, relay) -> None:
    from apsup.supervisor.runtime import MetricsHooks

    fam = configure("acc-manual", disabled=True, max_workers=2)
    hooks = MetricsHooks(SupervisorMetrics(families=[fam.name]), relay)
    host = hosts.live_host(
        [fam], backoff=SLOW_BACKOFF, hooks=hooks, worker_settings=dict(relay.env())
    )
    request(store, fam, "leak.1")
    host.run_until(
        lambda: (s := _state(store, fam, "leak.1")) and s.consecutive_failures, "a failure"
    )
    state = _state(store, fam, "leak.1")
    assert state is not None
    assert state.consecutive_failures == 1 and state.last_error_type == "ValueError"
    assert state.last_error is not None and "boom-token-7731" in state.last_error
    assert "hunter2pw" not in state.last_error and "s3cr3t-value" not in state.last_error
    assert state.next_attempt_at is not None and state.last_failure_at is not None
    # The host's /status lists it, worst first, with the same redacted message.
    fam_status = _observe(host)["supervisors"][0]["families"][fam.name]
    assert fam_status["failing_count"] == 1
    (listed,) = fam_status["failing"]
    assert listed["scope"] == "leak.1" and listed["consecutive_failures"] == 1
    assert (
        "boom-token-7731" in listed["error"]
        and "hunter2pw" not in orjson.dumps(fam_status).decode()
    )
    # So does `apsup status --db --json`, from the database alone.
    out = _cli(store, "status", "--json")
    assert out.returncode == 0, out.stderr
    view = orjson.loads(out.stdout)["families"][fam.binding_name]
    assert view["failing_count"] == 1 and view["failing"][0]["scope"] == "leak.1"
    assert "boom-token-7731" in view["failing"][0]["error"]
    assert "hunter2pw" not in out.stdout and "s3cr3t-value" not in out.stdout
    text = _cli(store, "status", "--once")
    assert "leak.1" in text.stdout and "boom-token-7731" in text.stdout, text.stdout
    # `apsup scopes list --failing` shows it too.
    listing = _cli(
        store,
        "scopes",
        "list",
        fam.name,
        "--failing",
        "--json",
        "--app",
        "tests.acceptance.cli_app",
    )
    assert listing.returncode == 0, listing.stderr
    (row,) = orjson.loads(listing.stdout)["scopes"]
    assert row["scope"] == "leak.1" and row["consecutive_failures"] == 1


def test_retry_runs_within_one_poll_not_at_the_backoff_time(hosts, store) -> None:
    fam = configure("acc-manual", disabled=True, max_workers=2)
    host = hosts.live_host([fam], backoff=SLOW_BACKOFF)
    request(store, fam, "exit1.r")  # the first attempt fails, the next one succeeds
    host.run_until(
        lambda: len(scope_events(store, fam, "exit1.r")) == 1 and not host.supervisor.running,
        "the first failure",
    )
    host.run_for(1.0)
    assert not handled(store, fam, "exit1.r")  # waiting for its 30 s backoff
    message = _act(store, operator.retry, fam, "exit1.r")
    assert "retry requested" in message
    t0 = time.monotonic()
    host.host.wake()
    host.run_until(lambda: handled(store, fam, "exit1.r"), "the retried invocation", limit=15)
    assert time.monotonic() - t0 < 10  # a poll (0.3 s here) and a launch, not 30 s
    host.run_until(lambda: _state(store, fam, "exit1.r") is None, "success clears the failure")


def test_park_survives_a_restart_and_unpark_resumes(hosts, store) -> None:
    fam = configure("acc-manual", disabled=True, max_workers=2)
    request(store, fam, "ok.p")
    _act(store, operator.park, fam, "ok.p")
    host = hosts.live_host([fam])
    host.run_for(1.5)
    assert completed(store, fam, "ok.p") == 0  # accepted and kept, never dispatched
    host.close()
    term_before = host.supervisor.term
    host = hosts.live_host([fam])  # a new term: what a leadership change does
    host.run_for(1.5)
    assert completed(store, fam, "ok.p") == 0 and term_before is None
    request(store, fam, "ok.p")  # more requests are accepted while parked
    host.run_for(0.5)
    assert completed(store, fam, "ok.p") == 0
    assert "unparked" in _act(store, operator.unpark, fam, "ok.p")
    host.host.wake()
    host.run_until(lambda: handled(store, fam, "ok.p"), "the unparked Scope runs")


def test_stop_ends_the_running_invocation_and_parks_the_scope(hosts, store) -> None:
    """A stop is the operator's decision, not a failure: it counts none and sets no backoff,
    so an unpark runs the kept request within a poll (the backoff here is a minute)."""
    fam = configure("acc-manual", disabled=True, max_workers=2, timeout=120)
    host = hosts.live_host([fam], backoff=(60.0, 60.0))
    request(store, fam, "gate.s")  # waits for a flag that never comes
    host.run_until(lambda: host.supervisor.running, "a running Worker")
    _act(store, operator.stop, fam, "gate.s")
    host.host.wake()
    host.run_until(lambda: not host.supervisor.running, "the stopped Worker's exit", limit=30)
    state = _state(store, fam, "gate.s")
    assert state is not None and state.parked and not state.stop_requested
    assert state.consecutive_failures == 0 and state.next_attempt_at is None  # no failure
    assert host.supervisor.failed[fam.name] == 0
    host.run_for(1.5)  # parked: nothing runs
    assert len(scope_events(store, fam, "gate.s")) == 1 and not handled(store, fam, "gate.s")
    assert "unparked" in _act(store, operator.unpark, fam, "gate.s")
    host.host.wake()
    host.run_until(
        lambda: len(scope_events(store, fam, "gate.s")) == 2, "the kept request ran again", limit=10
    )


def test_pause_holds_across_a_restart_and_resume_runs(hosts, store) -> None:
    fam = configure("acc-manual", disabled=True, max_workers=2)
    host = hosts.live_host([fam])
    assert "paused" in _act(store, operator.pause, fam)
    host.host.wake()
    host.run_for(0.5)
    request(store, fam, "ok.z")
    host.run_for(1.5)
    assert completed(store, fam, "ok.z") == 0
    assert _observe(host)["supervisors"][0]["families"][fam.name]["paused"] is True
    host.close()
    host = hosts.live_host([fam])  # a new term still sees the pause
    host.run_for(1.5)
    assert completed(store, fam, "ok.z") == 0
    assert "resumed" in _act(store, operator.resume, fam)
    host.host.wake()
    host.run_until(lambda: handled(store, fam, "ok.z"), "the resumed family runs")


def test_the_cli_says_what_it_changed_and_refuses_unknown_names(store) -> None:
    fam = configure("acc-manual", disabled=True)
    request(store, fam, "ok.c", tell=False)
    app = ["--app", "tests.acceptance.cli_app"]
    for args, expect in (
        (["scopes", "park", fam.name, "ok.c"], "parked"),
        (["scopes", "unpark", fam.name, "ok.c"], "unparked"),
        (["scopes", "retry", fam.name, "ok.c"], "not failing; nothing to retry"),
        (["scopes", "stop", fam.name, "ok.c"], "stop requested"),
        (["families", "pause", fam.name], "paused"),
        (["families", "resume", fam.name], "resumed"),
    ):
        out = _cli(store, *args, *app)
        assert out.returncode == 0, (args, out.stderr)
        assert expect in out.stdout, (args, out.stdout)
    listing = _cli(store, "scopes", "list", fam.name, *app)
    assert listing.returncode == 0 and "ok.c" in listing.stdout, listing.stderr
    for args, word in (
        (["scopes", "park", "no-such-family", "x"], "unknown family"),
        (["scopes", "retry", fam.name, "never-seen"], "no Scope"),
        (["families", "pause", "no-such-family"], "unknown family"),
    ):
        out = _cli(store, *args, *app)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and word in lines[0] and "Traceback" not in out.stderr, out.stderr
