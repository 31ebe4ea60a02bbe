"""RFC acceptance 7: with automatic processing disabled, ordinary dirty work does not run, while
explicit triggers (the real ``apsup trigger`` CLI in a subprocess) and accepted requests still
run, including one accepted while no host was running (recovered at startup).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.acceptance.families import configure
from tests.acceptance.harness import (
    REPO_ROOT,
    completed,
    handled,
    intent,
    mark_dirty,
    request,
    scan_state,
    scope_events,
)

pytestmark = pytest.mark.timeout(180)


def apsup_trigger(db_url: str, family: str, scope: str) -> str:
    script = Path(sys.executable).with_name("apsup")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "apsup.cli"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [*command, "trigger", "--app", "tests.acceptance.cli_app", "--db", db_url, family, scope],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"apsup trigger failed ({done.returncode}): {done.stderr}"
    assert "accepted" in done.stdout, done.stdout
    return done.stdout


def test_disabled_type_runs_only_explicit_and_accepted_requests(hosts, store):
    fam = configure("acc-manual", disabled=True, max_workers=2)
    mark_dirty(store, fam, "ok.dirty1")
    mark_dirty(store, fam, "ok.dirty2")
    # Accepted while no host runs: one through the CLI, one by domain code (lost notification).
    out = apsup_trigger(store.url, fam.name, "ok.cli-before")
    if store.name == "sqlite":
        assert "no local host notified" in out
    request(store, fam, "ok.api-before")

    host = hosts.live_host([fam])
    host.run_until(
        lambda: handled(store, fam, "ok.cli-before") and handled(store, fam, "ok.api-before"),
        "requests accepted before startup are recovered",
    )
    apsup_trigger(store.url, fam.name, "ok.cli-live")
    apsup_trigger(store.url, fam.name, "ok.dirty2")  # an explicit trigger for a dirty Scope
    host.run_until(
        lambda: handled(store, fam, "ok.cli-live") and handled(store, fam, "ok.dirty2"),
        "explicit triggers run while the host is up",
    )
    host.run_for(1.0)  # room for a wrongly admitted dirty Scope to show up

    assert scope_events(store, fam, "ok.dirty1") == [], "ordinary dirty work ran"
    row = intent(store, fam, "ok.dirty1")
    assert row.dirty_generation > row.clean_generation and row.requested_generation == 0
    st = scan_state(store, fam)
    assert st is not None and st.scan_generation == 0 and st.checkpoint is None, (
        "an automatic check started for a disabled type"
    )
    assert completed(store, fam) == 4
    assert intent(store, fam, "ok.dirty2").clean_generation == 1  # its processor cleaned it
