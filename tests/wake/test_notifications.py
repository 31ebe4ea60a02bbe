"""PostgreSQL: a publisher's commit wakes the leader by LISTEN/NOTIFY (``notifications``).

- A real host whose poll is off runs a request another session commits: the notification
  alone woke it.
- A rolled-back transaction's notification is never delivered; a committed one is, once.
- A listener whose connection the server ended reconnects by itself and asks for a full request
  pass (what was sent meanwhile is lost); one that cannot connect returns nothing and leaves
  the poll to find requests, without raising into the host's loop.
- Notifications can be switched off in a publisher process.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import text

from apsup.store import connect, migrate
from apsup.supervisor import notifications
from apsup.supervisor.host import LeasePolicy
from apsup.supervisor.notifications import ALL, NotificationListener
from tests.liveness_families import live_work
from tests.liveness_support import cycle_for, cycle_until, handled, live_host, request

pytestmark = [pytest.mark.timeout(240), pytest.mark.backends("postgresql")]


def _drained(listener: NotificationListener, seconds: float = 1.0) -> set[str]:
    """What the listener delivers within ``seconds`` (notifications arrive asynchronously)."""
    end = time.monotonic() + seconds
    got: set[str] = set()
    while time.monotonic() < end:
        got |= listener.drain()
        time.sleep(0.02)
    return got


def test_a_commit_wakes_the_leader_whose_poll_is_off(db_url: str, tmp_path: Path) -> None:
    """A real host and Workers; once the leader is up, its poll is pushed an hour away: the
    request another session commits then starts only if its notification wakes the leader."""
    with live_host(db_url, [live_work], tmp_path, lease=LeasePolicy(3.0, 1.0, 30.0)) as bundle:
        host, backend = bundle.host, bundle.backend
        assert host.listener is not None  # every host on PostgreSQL listens
        g = request(backend, live_work, "ok.warm-up")
        cycle_until(host, lambda: handled(backend, live_work, "ok.warm-up", g), 30, "the warm-up")
        cycle_for(host, 0.5)  # its exit classified, the listener's first pass consumed
        host._next_poll = time.monotonic() + 3600  # no poll from now on
        started = time.monotonic()
        g = request(backend, live_work, "ok.woken")
        cycle_until(host, lambda: handled(backend, live_work, "ok.woken", g), 20, "the wake-up")
        took = time.monotonic() - started
        assert host._next_poll - time.monotonic() < 60  # woken: the fast poll is back on
    print(f"\n[postgresql] notified request -> handled in {took * 1000:.0f} ms, poll off")


def test_only_a_committed_transaction_notifies(db_url: str) -> None:
    migrate(db_url)
    engine = connect(db_url)
    listener = NotificationListener(db_url)
    try:
        assert listener.drain() == {ALL}  # connected: a full pass first
        with engine.connect() as conn:
            trans = conn.begin()
            live_work.request(conn, "rolled-back")
            trans.rollback()
        assert _drained(listener) == set()
        time.sleep(notifications.MIN_INTERVAL)
        with engine.begin() as conn:
            live_work.request(conn, "committed")
        assert _drained(listener) == {live_work.name}
        assert _drained(listener, 0.3) == set()  # once
    finally:
        listener.close()
        engine.dispose()


def test_a_lost_listener_reconnects_and_asks_for_a_full_pass(db_url: str) -> None:
    migrate(db_url)
    engine = connect(db_url)
    listener = NotificationListener(db_url)
    try:
        assert listener.drain() == {ALL}
        with engine.begin() as conn:  # the server ends the listening session
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = 'apsup-listener' AND datname = current_database()"
                )
            )
        got = _drained(listener, 2.0)
        assert listener.connects == 2 and ALL in got
        time.sleep(notifications.MIN_INTERVAL)
        with engine.begin() as conn:
            live_work.request(conn, "after-reconnect")
        assert live_work.name in _drained(listener)  # listening again
    finally:
        listener.close()
        engine.dispose()


def test_an_unreachable_server_leaves_the_poll_in_charge(db_url: str) -> None:
    from tests.seekdb_server import free_loopback_port

    url = db_url.replace(
        db_url.split("@", 1)[1].split("/", 1)[0], f"127.0.0.1:{free_loopback_port()}"
    )
    listener = NotificationListener(url)
    try:
        assert listener.drain() == set()  # refused: a warning, no exception
        assert listener.fileno() is None and listener.due() is not None
        assert listener.drain() == set()  # not retried before its backoff
    finally:
        listener.close()


def test_a_publisher_can_switch_notifications_off(db_url: str) -> None:
    migrate(db_url)
    engine = connect(db_url)
    listener = NotificationListener(db_url)
    notifications.set_enabled(False)
    try:
        assert listener.drain() == {ALL}
        with engine.begin() as conn:
            live_work.request(conn, "silent")
        assert _drained(listener) == set()
    finally:
        notifications.set_enabled(True)
        listener.close()
        engine.dispose()
