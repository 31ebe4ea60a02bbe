"""Wake-ups without a notify call: a request or dirty mark committed by another process reaches
an idle SQLite host at once, the host issues no statement while idle, and a lost wake-up is
recovered without a restart.

Everything runs as real processes: the host is ``apsup run --app wakeapp.families`` started from
the application's own folder, and each publisher is a separate Python process using its own
SQLAlchemy engine. The measured figures are printed (``pytest -s``); the assertions on time are
the product's bound (1 s to react) or generous bounds, never a benchmark.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from apsup.supervisor.control import WATCH_SECONDS, socket_path
from tests.wake.support import LIMIT, App, Host, make_app

pytestmark = pytest.mark.timeout(180)

REACTION_BOUND = 1.0  # the guarantee: a committed wake-up reaches the host within 1 s


@pytest.fixture
def app(tmp_path: Path) -> App:
    return make_app(tmp_path)


@pytest.fixture
def host(app: App):  # type: ignore[no-untyped-def]
    h = Host(app).start().wait_ready()
    try:
        yield h
    finally:
        h.stop()


def _assert_idle(host: Host, seconds: float) -> None:
    since = time.time()
    time.sleep(seconds)
    assert host.activity(after=since) == [], "the idle host issued database statements"


def _reaction(host: Host, published: dict[str, float]) -> float:
    """Seconds from the end of the publisher's commit to the host's first statement after it
    began (negative when the host already waited on the write lock during the commit)."""
    deadline = time.monotonic() + LIMIT
    while time.monotonic() < deadline:
        seen = host.activity(after=published["before"])
        if seen:
            return seen[0][0] - published["committed"]
        time.sleep(0.01)
    raise AssertionError("the host never reacted to the commit")


@pytest.mark.parametrize("engine", ["plain", "apsup", "async"])
def test_request_from_another_process_wakes_the_idle_host(
    app: App, host: Host, engine: str
) -> None:
    """Automatic admission disabled: only the wake-up can get this request handled."""
    host.wait_quiet()
    _assert_idle(host, 3.0)

    published = app.publish("request", "manual", f"req-{engine}", engine)
    reaction = _reaction(host, published)
    started = app.wait_run("wake-manual", f"req-{engine}")
    print(
        f"\n[{engine} engine] host reacted {reaction * 1000:.1f} ms after the commit; "
        f"processor started {(started - published['committed']) * 1000:.1f} ms after it"
    )
    assert reaction < REACTION_BOUND

    host.wait_quiet()
    _assert_idle(host, 5.0)


def test_mark_dirty_on_an_interval_family_reaches_the_idle_host(app: App, host: Host) -> None:
    """The hourly family's dirty mark wakes the host (one request pass: reads) at once; the
    dirty Scope itself is admitted at the family's next check, as its policy says."""
    host.wait_quiet()
    _assert_idle(host, 3.0)

    published = app.publish("mark_dirty", "hourly", "dirty-1")
    reaction = _reaction(host, published)
    print(f"\n[mark_dirty] host reacted {reaction * 1000:.1f} ms after the commit")
    assert reaction < REACTION_BOUND

    host.wait_quiet()
    _assert_idle(host, 5.0)
    assert "dirty-1" not in app.runs("wake-interval")  # admitted by the schedule, not the wake


def test_a_commit_the_hook_cannot_see_is_recovered_by_the_file_watch(app: App, host: Host) -> None:
    """A lost wake-up (here: intent written below the commit hook) is still found, in about a
    second, by the host's file watch: no restart, no statement while idle before it."""
    host.wait_quiet()
    _assert_idle(host, 2.0)
    published = app.publish("bypass", "manual", "lost-1")
    started = app.wait_run("wake-manual", "lost-1")
    latency = started - published["committed"]
    print(f"\n[lost wake-up] processor started {latency * 1000:.0f} ms after the commit")
    assert latency < WATCH_SECONDS + 5.0  # generous: one watch tick plus a loaded machine

    host.wait_quiet()
    _assert_idle(host, 3.0)


def test_commits_do_not_slow_down_or_fail_without_a_listening_host(app: App) -> None:
    """No host yet, then a dead host's socket left behind (SIGKILL): publishing still commits
    at once, and a host started later handles what was accepted meanwhile."""
    timings = []
    published = app.publish("request", "manual", "early-1")
    timings.append(published["committed"] - published["before"])

    dead = Host(app).start().wait_ready()
    dead.stop(signal.SIGKILL)
    assert socket_path(app.db).exists()  # a stale socket: nobody receives on it
    published = app.publish("request", "manual", "early-2")
    timings.append(published["committed"] - published["before"])
    print(f"\n[no host] commit durations {[f'{t * 1000:.1f} ms' for t in timings]}")
    assert max(timings) < 2.0  # generous: the send never blocks

    host = Host(app).start().wait_ready()
    try:
        app.wait_run("wake-manual", "early-1")
        app.wait_run("wake-manual", "early-2")
    finally:
        host.stop()


def test_a_frozen_host_slows_no_commit_and_catches_up(app: App, host: Host) -> None:
    """SIGSTOP: the host reads nothing, its socket queue fills up and later sends fail at once
    (lost wake-ups). Commits stay fast; after SIGCONT every request is handled."""
    host.wait_quiet()
    assert host.proc is not None
    host.proc.send_signal(signal.SIGSTOP)
    try:
        timings = []
        for i in range(15):  # more than the kernel queues for an unread datagram socket (10)
            published = app.publish("request", "manual", f"frozen-{i}")
            timings.append(published["committed"] - published["before"])
    finally:
        host.proc.send_signal(signal.SIGCONT)
    print(f"\n[frozen host] slowest commit {max(timings) * 1000:.1f} ms")
    assert max(timings) < 2.0  # generous: sends never block
    for i in range(15):
        app.wait_run("wake-manual", f"frozen-{i}")


def test_dedicated_mode_host_is_woken_too(app: App) -> None:
    """On SQLite, dedicated mode runs one Supervisor per family inside the one host: the
    wake-up reaches the Supervisor that owns the family."""
    host = Host(
        app, env={"POWERCONTEXT_SERVER_RUNTIME_ARTIFACT_PROCESSING_SUPERVISOR_MODE": "dedicated"}
    )
    host.start().wait_ready()
    try:
        host.wait_quiet()
        published = app.publish("request", "manual", "dedicated-1")
        assert _reaction(host, published) < REACTION_BOUND
        app.wait_run("wake-manual", "dedicated-1")
    finally:
        assert host.stop() == 0
