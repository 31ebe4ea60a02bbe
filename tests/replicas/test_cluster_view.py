"""Every replica tells the same cluster-wide truth (real replicas, MySQL, dedicated mode).

Two background replicas and an api replica share one database; the two families are led by
the background replicas' family processes. Each replica's ``/cluster``, its console page and
``apsup status`` (``--url`` alone, and ``--db``) must show every family with its leader by
replica name and the leader's live figures, and the failing Scope of a family that replica
does not lead, with its error redacted. Before, a replica showed only what it led itself: the
api replica's page said "no failing Scope" while one failed every 30 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.replicas.cluster import Cluster
from tests.replicas.support import wait_for

pytestmark = [pytest.mark.backends("mysql"), pytest.mark.timeout(240)]

PREFIX = "POWERCONTEXT_SERVER_RUNTIME_"
FAMILIES = ("replica-side", "replica-work")
HOSTILE = "fail.<script>alert(1)</script>\"'&"


def _get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        body = resp.read().decode()
    return json.loads(body) if path == "/cluster" else body


def _agreed(view: dict[str, Any]) -> dict[str, Any]:
    """What two replicas' views must agree on (live figures move between two reads)."""
    return {
        name: (
            fam["leader"]["replica"],
            fam["leader"]["generation"],
            fam["budget"],
            fam["failing_count"],
            [f["scope"] for f in fam["failing"]],
        )
        for name, fam in view["families"].items()
        if name in FAMILIES
    }


def _status(args: list[str], env_db: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    if env_db is not None:
        env[PREFIX + "DATABASE_URL"] = env_db
    return subprocess.run(
        [sys.executable, "-m", "apsup.cli", "status", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_every_replica_shows_the_whole_cluster(db_url: str, tmp_path: Path) -> None:
    Cluster.prepare(db_url)
    c = Cluster(db_url, tmp_path / "c", lease=3.0, renew=1.0, poll=0.5, mode="dedicated")
    try:
        a, b, api = c.start("background"), c.start("background"), c.start("api")
        c.wait_ready(a, b, api)
        for name in FAMILIES:  # held by a family process (its holder id is not the replica's)
            wait_for(
                lambda n=name: (
                    (v := c.lease(f"artifact:{n}")) is not None
                    and v.expires_at is not None
                    and v.expires_at > v.db_now
                ),
                60,
                f"a leader for {name}",
            )
        c.request("replica-work", HOSTILE)
        ports = [int(r.port or 0) for r in (a, b, api)]

        def settled() -> list[dict[str, Any]] | None:
            views = [_get(p, "/cluster") for p in ports]
            for v in views:
                fams = v["families"]
                if not all(n in fams and fams[n]["budget"] is not None for n in FAMILIES):
                    return None
                leaders = {fams[n]["leader"]["replica"] for n in FAMILIES}
                if None in leaders or len(leaders) != 2:  # placement spreads them: settled
                    return None
                if fams["replica-work"]["failing_count"] < 1:
                    return None
            agreed = [_agreed(v) for v in views]
            return views if all(x == agreed[0] for x in agreed) else None

        views = wait_for(settled, 60, "three replicas agreeing on both families and the failure")
        api_view = views[2]
        (failing,) = api_view["families"]["replica-work"]["failing"]
        assert failing["scope"] == HOSTILE
        assert "hunter2" not in failing["error"] and "cannot be processed" in failing["error"]
        replicas = {r["replica"]: r for r in api_view["replicas"]}
        # One row per background replica, its two family processes inside (an api replica
        # keeps no membership row: it leads nothing and runs no Worker).
        assert len(replicas) == 2, replicas
        assert all(r["state"] == "live" and len(r["processes"]) == 2 for r in replicas.values())
        leaders = {api_view["families"][n]["leader"]["replica"] for n in FAMILIES}
        assert leaders <= {name for name, r in replicas.items() if r["role"] == "background"}
        assert api_view["summary"]["status"] == "attention"
        assert any(i["kind"] == "failing" for i in api_view["summary"]["items"])

        # The api replica's console page: the failing Scope, escaped, no secret.
        page = _get(ports[2], "/")
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script>alert" not in page
        assert "hunter2" not in page
        for name in FAMILIES:
            assert f'data-family="{name}"' in page

        # apsup status --url alone (no database URL anywhere): the replica reads it.
        out = _status(["--url", f"http://127.0.0.1:{ports[2]}", "--json"], env_db=None)
        assert out.returncode == 0, out.stderr
        assert _agreed(json.loads(out.stdout)) == _agreed(api_view)
        text = _status(["--url", f"http://127.0.0.1:{ports[0]}", "--once"], env_db=None)
        assert text.returncode == 0, text.stderr
        assert "cluster: attention" in text.stdout and "hunter2" not in text.stdout
        # apsup status --db in dedicated mode: every family's live figures, not one process's.
        out = _status(["--db", db_url, "--json"], env_db=None)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert all(doc["families"][n]["budget"] is not None for n in FAMILIES), doc["families"]
        assert _agreed(doc) == _agreed(api_view)
    finally:
        c.close()
