"""A notification costs pages for the new requests, not for the Scopes waiting in backoff.

Scopes that fail keep their request pending while they wait for their next attempt; the
leader holds each of them in memory. A request pass used to read them all again at every
notification (a page per hundred failing Scopes, and on MySQL at every poll, since their
requests count as pending): with 250 failing Scopes, one new request cost 4 pages. Real hosts,
real failing Workers, both backends.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from apsup.scheduling import Backoff, KeyState
from apsup.store import open_backend, operator_state
from apsup.supervisor.host import Host
from apsup.supervisor.launcher import HostBundle
from apsup.supervisor.supervisor import BACKOFF_TERM_MARGIN, Hooks
from tests.liveness_families import live_work
from tests.liveness_support import cycle_until, handled, live_host, request

FAILING = 250  # two and a half pages of 100
#: Failing Scopes stay in backoff for the whole test.
LONG_BACKOFF = Backoff(base=600.0, factor=2.0, cap=600.0, jitter=0.0)


class PageCounter(Hooks):
    def __init__(self) -> None:
        self.pages = 0

    def observe_discovery(self, family: str, seconds: float) -> None:
        self.pages += 1  # live-work has no automatic check: every read is a request page


def _request_all(db_url: str, scopes: list[str]) -> None:
    """The application's side: its own connections, short transactions."""
    app = open_backend(db_url)
    try:
        for i in range(0, len(scopes), 50):
            with app.transaction() as conn:
                for scope in scopes[i : i + 50]:
                    live_work.request(conn, scope)
    finally:
        app.dispose()


def _all_waiting(host: Host, scopes: list[str]) -> bool:
    core = host.supervisors[0].core
    return core is not None and all(
        core.key_state(live_work.name, s) is KeyState.RETRY_WAIT for s in scopes
    )


@contextlib.contextmanager
def _failing_host(db_url: str, tmp_path: Path, pages: PageCounter) -> Iterator[HostBundle]:
    """A leader whose failures from now on are its term's own (past the clock margin)."""
    with live_host(db_url, [live_work], tmp_path, hooks=pages, backoff=LONG_BACKOFF) as bundle:
        t0 = time.monotonic()
        while time.monotonic() - t0 < BACKOFF_TERM_MARGIN.total_seconds() + 0.2:
            bundle.host.cycle(max_wait=0.2)
        yield bundle


def test_a_notification_reads_the_new_requests_not_the_failing_scopes(
    db_url: str, tmp_path: Path
) -> None:
    pages = PageCounter()
    with _failing_host(db_url, tmp_path, pages) as bundle:
        host, backend = bundle.host, bundle.backend
        failing = [f"fail.{i}" for i in range(FAILING)]
        _request_all(db_url, failing)
        host.supervisors[0].notify(live_work.name)
        cycle_until(host, lambda: _all_waiting(host, failing), 120, "every Scope failed once")
        core = host.supervisors[0].core
        assert core is not None
        cycle_until(
            host, lambda: not core.request_discovery_pending(live_work.name), 10, "passes end"
        )
        before = pages.pages
        g = request(backend, live_work, "ok.new")
        host.supervisors[0].notify(live_work.name)
        cycle_until(host, lambda: handled(backend, live_work, "ok.new", g), 30, "the new request")
        used = pages.pages - before
        print(f"\n{FAILING} Scopes in backoff: the new request cost {used} request page(s)")
        # One pass, one page (and at most one more pass for a notification that came in during
        # it, on MySQL the poll's); reading the failing Scopes would be 3 pages for each pass.
        assert used <= 2, used
        assert _all_waiting(host, failing)  # nothing was retried early


@pytest.mark.backends("mysql")
def test_an_idle_leader_with_only_failing_scopes_reads_no_request_page(
    db_url: str, tmp_path: Path
) -> None:
    """MySQL's poll counted a failing Scope's pending request as new work: a pass of every
    failing Scope at every poll, for ever."""
    pages = PageCounter()
    with _failing_host(db_url, tmp_path, pages) as bundle:
        host = bundle.host
        failing = [f"fail.{i}" for i in range(20)]
        _request_all(db_url, failing)
        cycle_until(host, lambda: _all_waiting(host, failing), 60, "every Scope failed once")
        before = pages.pages
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3 * host.lease.poll_seconds + 1:  # several polls
            host.cycle(max_wait=0.2)
        assert pages.pages - before == 0, pages.pages - before


def test_a_scope_an_earlier_term_left_in_backoff_is_found_by_its_next_request(
    db_url: str, tmp_path: Path
) -> None:
    """The one Scope a new term does not hold: failed under the previous term, no request
    pending at the takeover, then requested again while its recorded backoff still runs. Its
    failure state belongs to another term, so request pages read it."""
    with _failing_host(db_url, tmp_path, PageCounter()) as bundle:
        host, backend = bundle.host, bundle.backend
        g = request(backend, live_work, "ackfail.old")  # acknowledges, then fails
        cycle_until(host, lambda: handled(backend, live_work, "ackfail.old", g), 30, "ack")
        cycle_until(host, lambda: _all_waiting(host, ["ackfail.old"]), 30, "its failure")
    # A new host: a new term. The Scope's failure state names a backoff of 600 s.
    other = open_backend(db_url)
    try:
        with other.read() as conn:
            state = operator_state.scope_state(conn, live_work.binding_name, "ackfail.old")
        assert state is not None and state.next_attempt_at is not None
    finally:
        other.dispose()
    with _failing_host(db_url, tmp_path, PageCounter()) as bundle:
        host, backend = bundle.host, bundle.backend
        with backend.transaction() as conn:  # a new request: processed now
            g2 = live_work.request(conn, "ackfail.old")
        host.supervisors[0].notify(live_work.name)
        cycle_until(
            host, lambda: handled(backend, live_work, "ackfail.old", g2), 30, "the new request"
        )
