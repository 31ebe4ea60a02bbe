"""RFC acceptance 11 (SQLite half): SQLite does not accidentally enable multiprocess mode. A
second host on the same database file, through ``host_runner`` and through the real
``apsup run`` CLI, is refused with a clear error and exit code 3 while the first keeps running
with its term untouched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from apsup.store.leases import GLOBAL_KEY
from tests.acceptance.families import configure
from tests.acceptance.harness import REPO_ROOT, handled, request, wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.backends("sqlite")]

SPEC = {"acc-manual": {"disabled": True, "max_workers": 2}}


def _lease(store):
    (row,) = [r for r in store.lease_rows() if r.supervisor_key == GLOBAL_KEY]
    return row


def test_second_host_on_the_same_sqlite_file_is_refused(hosts, store):
    fam = configure("acc-manual", **SPEC["acc-manual"])
    first = hosts.process(SPEC)
    first.wait_ready()
    term = _lease(store)

    second = hosts.process(SPEC)
    assert second.wait() == 3
    assert "another apsup host" in second.errors()
    assert f"pid {first.pid}" in second.errors()

    script = Path(sys.executable).with_name("apsup")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "apsup.cli"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    cli = subprocess.run(
        [*command, "run", "--app", "tests.acceptance.cli_app", "--db", store.url],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=60,
        check=False,
    )
    assert cli.returncode == 3, (cli.returncode, cli.stderr[-2000:])
    assert "another apsup host" in cli.stderr and "SQLite supports a single host" in cli.stderr

    # The refused hosts changed nothing: same term, and the first host still does its work.
    assert _lease(store) == term
    assert first.alive()
    request(store, fam, "ok.after")
    wait_for(lambda: handled(store, fam, "ok.after"), "the first host handles a new request")

    first.signal(signal.SIGTERM)
    assert first.wait() == 0, first.errors()[-2000:]
