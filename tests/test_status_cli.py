"""``apsup status`` as a real subprocess over both backends (issue #6 point 4, RFC §12).

The database is seeded through the store API (intents, binding state, leases); the CLI runs as
``python -m apsup.cli status`` and its ``--json`` document and ``--once`` table are checked
figure by figure. A real ``HealthServer`` serving a fake snapshot stands in for a running host
to show the merge of in-memory and database figures; the password of a DSN never appears.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy.engine import make_url

from apsup.config import DEFAULT_PREFIX
from apsup.observability.health import HealthServer, Heartbeat
from apsup.store import intents, open_backend, scans

pytestmark = pytest.mark.backends("sqlite", "mysql", "postgresql")

REPO_ROOT = Path(__file__).resolve().parent.parent
HOLDER = "5f0c2a9e" + "1" * 24
CHECKPOINT = datetime(2026, 1, 2, 3, 4, 5, 678000)
GAMMA_CHECKPOINT = datetime(2026, 1, 2, 3, 0, 0)
SECRET = "S3cretPw91x"


# --- helpers -------------------------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(DEFAULT_PREFIX)}
    env.update(extra)
    return env


def _start(
    args: Sequence[str], env: dict[str, str] | None = None, sigint_ignored: bool = False
) -> subprocess.Popen[str]:
    def ignore_sigint() -> None:  # as a shell's background job or a CI runner starts it
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    return subprocess.Popen(
        [sys.executable, "-m", "apsup.cli", "status", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env=env if env is not None else _env(),
        preexec_fn=ignore_sigint if sigint_ignored else None,
    )


def run_all(
    *runs: Sequence[str] | tuple[Sequence[str], dict[str, str]],
) -> list[tuple[int, str, str]]:
    """Run several ``apsup status`` invocations concurrently; (returncode, stdout, stderr)."""
    procs = []
    for run in runs:
        if isinstance(run, tuple) and len(run) == 2 and isinstance(run[1], dict):
            procs.append(_start(run[0], run[1]))
        else:
            procs.append(_start(run))  # type: ignore[arg-type]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        results.append((proc.returncode, out, err))
    return results


def ok_json(result: tuple[int, str, str]) -> dict[str, Any]:
    code, out, err = result
    assert code == 0, err
    doc: dict[str, Any] = orjson.loads(out)
    return doc


def table(text: str) -> dict[str, dict[str, str]]:
    """The ``--once`` table as {family: {COLUMN: cell}} (cells are separated by 2+ spaces)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("FAMILY"))
    header = re.split(r"\s{2,}", lines[start].strip())
    rows: dict[str, dict[str, str]] = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        assert len(cells) == len(header), (header, cells)
        rows[cells[0]] = dict(zip(header, cells, strict=True))
    return rows


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def seed(backend: Any) -> dict[str, int]:
    """alpha: 2 dirty, 1 unacknowledged, scan #1 in progress; beta: 1 request, no scan;
    gamma: only binding state (scan #1 finished). Leases: global held, artifact:beta released."""
    with backend.transaction() as conn:
        for scope in ("a0", "a1", "a2"):
            intents.mark_dirty(conn, "alpha", scope)
        intents.request(conn, "alpha", "a0")
        intents.request(conn, "alpha", "a1")
        intents.mark_clean(conn, "alpha", "a2", 1, None)
        intents.acknowledge(conn, "alpha", "a1", 1, None)
        intents.request(conn, "beta", "b0")
        scans.start_scan(conn, "alpha", CHECKPOINT)
        gamma = scans.start_scan(conn, "gamma", GAMMA_CHECKPOINT)
        scans.end_scan(conn, "gamma", gamma.scan_generation)
        upper = intents.max_pending_sequence(conn, "alpha")
    # The dedicated term ends before the global one starts: two modes are never live together.
    released = backend.claim_term("artifact:beta", "b" * 32, 60.0)
    assert released is not None
    backend.release_term(released)
    term = backend.claim_term("global", HOLDER, 60.0)
    assert term is not None
    assert upper is not None
    beta = {r.supervisor_key: r.generation for r in backend.lease_rows()}["artifact:beta"]
    return {"global": term.generation, "artifact:beta": beta, "upper": upper}


# --- tests ---------------------------------------------------------------------------------------


def test_database_figures_without_a_host(backend: Any, db_url: str, backend_name: str) -> None:
    ids = seed(backend)
    port = closed_port()
    dead = f"http://127.0.0.1:{port}"
    as_json, once, unreachable = run_all(
        ["--db", db_url, "--json"],
        ["--db", db_url, "--once"],
        ["--db", db_url, "--once", "--url", f"http://admin:{SECRET}@127.0.0.1:{port}"],
    )

    doc = ok_json(as_json)
    assert doc["host"] == {"url": None, "available": False, "error": "no host status endpoint"}
    assert sorted(doc["families"]) == ["alpha", "beta", "gamma"]
    alpha, beta, gamma = (doc["families"][n] for n in ("alpha", "beta", "gamma"))
    assert (alpha["unacknowledged"], alpha["dirty"]) == (1, 2)
    assert alpha["last_scan"] == {
        "checkpoint": "2026-01-02T03:04:05.678000Z",
        "generation": 1,
        "in_progress": True,
        "upper_pending_sequence": ids["upper"],
    }
    assert (beta["unacknowledged"], beta["dirty"], beta["last_scan"]) == (1, 0, None)
    assert (gamma["unacknowledged"], gamma["dirty"]) == (0, 0)
    assert gamma["last_scan"]["in_progress"] is False
    assert gamma["last_scan"]["checkpoint"] == "2026-01-02T03:00:00Z"
    for fam in (alpha, beta, gamma):
        # In-memory figures are unknown without a host; the active global Lease leads them all
        # (beta's dedicated key was released, so it does not govern beta).
        for key in ("policy", "due_at", "budget", "running", "ready", "retry_wait"):
            assert fam[key] is None, key
        assert fam["leader"]["key"] == "global"
        assert fam["leader"]["holder"] == HOLDER
        assert fam["leader"]["generation"] == ids["global"]
        assert fam["leader"]["state"] == "active"
    leases = {lease["key"]: lease for lease in doc["leases"]}
    assert leases["artifact:beta"]["state"] == "released"
    assert leases["artifact:beta"]["holder"] is None
    assert (leases["global"]["expires_at"] is None) == (backend_name == "sqlite")

    code, out, err = once
    assert code == 0, err
    assert "no host status endpoint" in out
    rows = table(out)
    assert rows["alpha"]["UNACKED"] == "1" and rows["alpha"]["DIRTY"] == "2"
    assert rows["alpha"]["LAST SCAN"].endswith("ago #1 scanning")
    assert rows["alpha"]["LEADER"] == f"global#{ids['global']} {HOLDER[:8]}"
    assert rows["beta"]["LAST SCAN"] == "-"
    assert rows["gamma"]["LAST SCAN"].endswith("ago #1")
    for column in ("POLICY", "NEXT DUE", "CAPACITY", "READY", "RETRY-WAIT", "STATUS"):
        assert {row[column] for row in rows.values()} == {"-"}, column

    code, out, err = unreachable  # the --url carried credentials: they are not shown
    assert code == 0, err
    assert f"no host status endpoint: {dead} unavailable" in out
    assert SECRET not in out and "admin" not in out
    assert table(out)["alpha"]["CAPACITY"] == "-"


def _snapshot(now: datetime) -> dict[str, Any]:
    def iso(value: datetime) -> str:
        return value.isoformat() + "Z"

    return {
        "role": "all",
        "mode": "global",
        "heartbeat_age": 0.0,
        "supervisors": [
            {
                "key": "global",
                "leader": True,
                "holder": HOLDER,
                "generation": 1,
                "families": {
                    "alpha": {
                        "status": "degraded",
                        "reason": "discovery failed: OperationalError",
                        "policy": "interval 300s",
                        "budget": 4,
                        "running": 3,
                        "ready": 2,
                        "retry_wait": 1,
                        "next_retry_at": iso(now + timedelta(minutes=10)),
                        "due_at": iso(now + timedelta(hours=1)),
                        "unacknowledged": 7,  # stale in-memory count: the database count wins
                    },
                    "delta": {
                        "status": "disabled",
                        "reason": "automatic admission disabled",
                        "budget": 2,
                        "running": 0,
                        "ready": 0,
                        "retry_wait": 0,
                        "next_retry_at": None,
                        "due_at": None,
                        "unacknowledged": 0,
                    },
                },
            }
        ],
    }


def test_host_status_endpoint_is_merged(backend: Any, db_url: str) -> None:
    ids = seed(backend)
    snapshot = _snapshot(backend.now())
    with HealthServer(status=lambda: snapshot, heartbeat=Heartbeat()) as server:  # type: ignore[arg-type,return-value]
        url = f"http://127.0.0.1:{server.port}"
        discovered = _env(**{DEFAULT_PREFIX + "HTTP_PORT": str(server.port)})
        as_json, once = run_all(
            (["--db", db_url, "--json"], discovered), ["--db", db_url, "--once", "--url", url]
        )

    doc = ok_json(as_json)  # the endpoint was discovered from ..._HTTP_PORT
    host = doc["host"]
    assert host["url"] == url and host["available"] is True
    assert (host["mode"], host["role"], host["readiness"]) == ("global", "all", "degraded")
    alpha = doc["families"]["alpha"]
    assert (alpha["budget"], alpha["running"], alpha["ready"], alpha["retry_wait"]) == (4, 3, 2, 1)
    assert alpha["policy"] == "interval 300s"
    assert alpha["status"] == "degraded" and "discovery failed" in alpha["reason"]
    assert (
        alpha["next_retry_at"] == snapshot["supervisors"][0]["families"]["alpha"]["next_retry_at"]
    )
    assert alpha["due_at"] == snapshot["supervisors"][0]["families"]["alpha"]["due_at"]
    assert (alpha["unacknowledged"], alpha["dirty"]) == (1, 2)  # from the database
    assert alpha["last_scan"]["generation"] == 1 and alpha["last_scan"]["in_progress"] is True
    assert alpha["supervisor_key"] == "global" and alpha["host_is_leader"] is True
    assert alpha["leader"]["generation"] == ids["global"]
    # A family only the host knows is listed (database counts 0); one only the database knows
    # keeps its database figures with in-memory columns unknown.
    delta = doc["families"]["delta"]
    assert (delta["status"], delta["policy"], delta["budget"]) == ("disabled", "disabled", 2)
    assert (delta["unacknowledged"], delta["dirty"], delta["last_scan"]) == (0, 0, None)
    assert doc["families"]["beta"]["running"] is None
    assert doc["families"]["beta"]["unacknowledged"] == 1

    code, out, err = once
    assert code == 0, err
    assert f"host {url}" in out and "readiness degraded" in out
    rows = table(out)
    assert rows["alpha"]["CAPACITY"] == "3/4"
    assert rows["alpha"]["POLICY"] == "interval 300s"
    assert rows["alpha"]["NEXT DUE"].startswith("in ")
    assert rows["alpha"]["RETRY-WAIT"].startswith("1 (in ")
    assert rows["alpha"]["STATUS"] == "degraded"
    assert rows["delta"]["CAPACITY"] == "0/2" and rows["delta"]["STATUS"] == "disabled"
    assert rows["beta"]["CAPACITY"] == "-"
    assert "alpha: degraded: discovery failed: OperationalError" in out


@pytest.mark.parametrize("inherited", ["sigint-default", "sigint-ignored"])
def test_live_view_refreshes_until_interrupted(backend: Any, db_url: str, inherited: str) -> None:
    """Ctrl-C quits the live view, also when its parent started it with SIGINT ignored."""
    seed(backend)
    proc = _start(
        ["--db", db_url, "--interval", "0.2"], sigint_ignored=inherited == "sigint-ignored"
    )
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buffer = ""
    deadline = time.monotonic() + 30

    def next_frame() -> str:
        nonlocal buffer
        marker = "Ctrl-C to quit\n"
        while marker not in buffer:
            assert time.monotonic() < deadline, buffer
            assert sel.select(timeout=1.0) is not None
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, f"status exited early: {proc.poll()} {buffer}"
            buffer += line
        frame, _, buffer = buffer.partition(marker)
        return frame

    try:
        assert table(next_frame())["alpha"]["DIRTY"] == "2"
        with backend.transaction() as conn:
            intents.mark_dirty(conn, "alpha", "a3")
        while table(next_frame())["alpha"]["DIRTY"] != "3":
            pass
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        assert proc.stderr is not None
        proc.stderr.close()


def test_missing_or_unmigrated_database_exits_2(db_url: str, backend_name: str) -> None:
    if backend_name == "sqlite":
        path = Path(make_url(db_url).database or "")
        ((code, out, err),) = run_all(["--db", db_url, "--once"])
        assert code == 2 and out == ""
        assert "no database at" in err and "apsup migrate" in err
        assert not path.exists(), "status must not create the database"
        open_backend(db_url, create=True).dispose()  # an empty file: exists, but has no schema
        ((code, out, err),) = run_all(["--db", db_url, "--json"])
    else:
        missing = make_url(db_url).set(database="apsup_no_such_db")
        gone, (code, out, err) = run_all(
            ["--db", missing.render_as_string(hide_password=False), "--json"],
            ["--db", db_url, "--once"],  # the fresh database exists but is not migrated
        )
        assert gone[0] == 2 and gone[1] == ""
        assert "does not exist" in gone[2] and "apsup migrate" in gone[2]
    assert code == 2 and out == ""
    assert "no apsup schema" in err and "apsup migrate" in err


def test_dsn_password_is_never_printed(
    backend: Any, db_url: str, backend_name: str, request: pytest.FixtureRequest
) -> None:
    seed(backend)
    dead_dsn = f"mysql+pymysql://apsup:{SECRET}@127.0.0.1:{closed_port()}/apsup?ssl_key={SECRET}"
    runs: list[Any] = [
        # the default URL from the environment, and --db: unreachable, so an error is printed
        (["--once"], _env(**{DEFAULT_PREFIX + "DATABASE_URL": dead_dsn})),
        ["--db", dead_dsn, "--json"],
    ]
    expected = [1, 1]
    if backend_name == "mysql":
        # A real user with a password: the full view, and a wrong-password failure.
        admin = request.getfixturevalue("mysql_url_admin")
        database = make_url(db_url).database
        conn = _admin_conn(admin)
        user = _create_user(conn, SECRET)
        try:
            with conn.cursor() as cur:
                cur.execute(f"GRANT ALL PRIVILEGES ON `{database}`.* TO '{user}'@'%'")
            with_pw = make_url(db_url).set(username=user, password=SECRET)
            good = with_pw.render_as_string(hide_password=False)
            bad = with_pw.set(password=SECRET + "x").render_as_string(hide_password=False)
            runs += [["--db", good, "--once"], ["--db", bad, "--once"]]
            expected += [0, 2]
            results = run_all(*runs)
        finally:
            with conn.cursor() as cur:
                cur.execute(f"DROP USER IF EXISTS '{user}'@'%'")
            conn.close()
        out = results[2][1]
        assert table(out)["alpha"]["UNACKED"] == "1"
        assert user not in out  # credentials are dropped from the shown URL entirely
        assert "denied" in results[3][2]
    else:
        results = run_all(*runs)
    for (code, out, err), want in zip(results, expected, strict=True):
        assert code == want, (out, err)
        assert SECRET not in out and SECRET not in err
        assert (out if want == 0 else err).strip()
    assert "cannot read mysql+pymysql://127.0.0.1:" in results[0][2]


def _create_user(conn: Any, password: str) -> str:
    """A fresh user under a name never used before on this server.

    Reusing a name (``DROP USER IF EXISTS`` then ``CREATE USER``) failed once on seekdb with
    error 1396: the drop had not yet reached the schema the create was checked against.
    """
    import pymysql

    for attempt in range(5):
        user = f"st_{uuid.uuid4().hex[:12]}"
        try:
            with conn.cursor() as cur:
                cur.execute(f"CREATE USER '{user}'@'%' IDENTIFIED BY '{password}'")
            return user
        except pymysql.err.OperationalError as exc:
            if exc.args[0] != 1396 or attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def _admin_conn(admin_url: str) -> Any:
    import pymysql

    u = make_url(admin_url)
    return pymysql.connect(
        host=u.host or "127.0.0.1",
        port=u.port or 3306,
        user=u.username or "root",
        password=u.password or "",
        autocommit=True,
        connect_timeout=10,
    )
