"""MySQL/OceanBase: a publisher's commit nudges the leader, which then starts the request without
waiting for its poll (``apsup.supervisor.nudge``).

The leader (``apsup run``) idles with ``POLL_SECONDS=30``: its adaptive poll has backed off to
several seconds between statements when the request comes. Each request must start within
``PROMPT`` seconds of its commit, and the leader's statement log must show the nudge's path: a
locking read of that Scope's intent row (the barrier that waits for the publisher's COMMIT). A
publisher nudges only when a leader holds the family's Lease, and without one its commit is
unchanged (the other wake-up tests publish with no host at all).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.wake.support import Host, make_app

pytestmark = [pytest.mark.timeout(240), pytest.mark.backends("mysql")]

IDLE = 9.0  # after the fast-poll hold, the poll interval has grown past ~3 s by then
PROMPT = 1.5
ROUNDS = 2


def test_a_commit_nudges_the_leader_past_its_backed_off_poll(db_url: str, tmp_path: Path) -> None:
    app = make_app(tmp_path, url=db_url)
    leader = Host(app, env={"POWERCONTEXT_SERVER_RUNTIME_POLL_SECONDS": "30"}).start()
    leader.wait_ready()
    try:
        app.publish("request", "manual", "warm-up")
        app.wait_run("wake-manual", "warm-up")
        latencies = []
        for i in range(ROUNDS):
            time.sleep(IDLE)
            scope = f"nudged-{i}"
            published = app.publish("request", "manual", scope)
            started = app.wait_run("wake-manual", scope)
            latencies.append(started - published["committed"])
            locks = [
                what
                for at, what in leader.activity(after=published["before"])
                if "FOR UPDATE" in what.upper() and "intents" in what
            ]
            assert locks, leader.activity(after=published["before"])
    finally:
        assert leader.stop() == 0
    print(f"\n[mysql] nudged request->start after {IDLE:g} s idle: {latencies}")
    assert max(latencies) < PROMPT, latencies
