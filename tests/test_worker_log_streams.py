"""A Worker's log streams travel with its launch (both backends).

The host opens the three streams of an invocation (structured records, stdout, stderr) and
passes the Worker's ends with the launch message; the Worker neither connects to the relay nor
sends a header. Everything it logs, prints or writes to fd 2 still reaches the host's log with
the invocation's fields, its failure is reported, every stream is closed once it exits, and
a Worker launched without streams still connects them itself.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import pytest

from apsup.observability.worker_logs import WorkerLogRelay
from apsup.store import migrate, open_backend
from apsup.supervisor.launcher import build_host
from apsup.supervisor.supervisor import Hooks
from tests import visibility_families as fams

pytestmark = pytest.mark.timeout(120)


class RelayHooks(Hooks):
    def __init__(self, relay: WorkerLogRelay, pass_streams: bool) -> None:
        self.relay = relay
        self.pass_streams = pass_streams
        self.details: list[dict[str, Any]] = []

    def launch_streams(self, worker_id: str, fields: dict[str, Any]) -> tuple[int, ...]:
        return self.relay.open_streams(fields) if self.pass_streams else ()

    def exit_details(self, worker_id: str, exitcode: int) -> dict[str, Any]:
        found = self.relay.take_exception(worker_id, 5.0)
        self.details.append(found)
        return found


@pytest.mark.parametrize("pass_streams", [True, False], ids=["with-launch", "connected"])
def test_a_workers_output_reaches_the_host_log_with_its_fields(
    db_url: str, caplog: pytest.LogCaptureFixture, pass_streams: bool
) -> None:
    migrate(db_url)
    fam = fams.vis_fail
    backend = open_backend(db_url)
    try:
        with backend.transaction() as conn:
            fam.request(conn, "scope-streams")
    finally:
        backend.dispose()
    relay = WorkerLogRelay(level=logging.INFO)
    hooks = RelayHooks(relay, pass_streams)
    fds_before = len(os.listdir("/proc/self/fd"))
    try:
        with caplog.at_level(logging.INFO, logger="apsup.worker"):
            bundle = build_host(
                db_url, [fam], worker_settings=relay.env(), hooks=hooks, shutdown_grace=2.0
            )
            try:
                host, sup = bundle.host, bundle.host.supervisors[0]
                host.start()
                end = time.monotonic() + 60
                while sup.failed[fam.name] < 1 and time.monotonic() < end:
                    host.cycle(max_wait=0.5)
                assert sup.failed[fam.name] == 1
            finally:
                bundle.host.shutdown()
                bundle.close()
            end = time.monotonic() + 10
            while relay._workers and time.monotonic() < end:  # every stream reached its EOF
                time.sleep(0.05)
            assert relay._workers == {}
    finally:
        relay.close()
    lines = {
        r.getMessage(): getattr(r, "apsup_fields", {})
        for r in caplog.records
        if r.name.startswith(("apsup.worker", "tests.visibility"))
    }
    for text in ("processing scope-streams", "plain print line", "stray stderr line"):
        assert text in lines, sorted(lines)
        assert lines[text]["scope"] == "scope-streams" and lines[text]["family"] == fam.name
    assert "raw fd 2 line" in lines
    assert "debug detail that the INFO host drops" not in lines
    # The failure record: the exception's type and frames, its message withheld.
    assert hooks.details and "raised RuntimeError" in hooks.details[0]["error"], hooks.details
    assert hooks.details[0]["frames"]
    assert fams.SECRET_TEXT not in str(hooks.details)
    # With the streams in the launch, no Worker connected to the relay; without, all three did.
    assert relay.accepted == (0 if pass_streams else 3)
    assert len(os.listdir("/proc/self/fd")) <= fds_before  # nothing left open in the host
