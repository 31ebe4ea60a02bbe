"""Operator visibility on a real host process (both backends): a processor's logging, print and
stray stderr reach the host's JSON log framed with the invocation's fields; a failure record
names the real exception type with frames but not the message (unless the Family opts in); a
hung processor makes ``apsup_oldest_running_seconds`` grow; the unacknowledged-requests gauge
agrees with ``apsup status`` for a request no event announced; HEAD on the health endpoints.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from apsup.store import migrate, open_backend
from apsup.supervisor.control import notify
from tests import visibility_families as fams

pytestmark = pytest.mark.timeout(240)

FIELDS = ("family", "binding", "scope", "worker_id", "term", "request_generation")
REPO = Path(__file__).resolve().parent.parent


class Host:
    def __init__(self, db_url: str, workdir: Path, *extra: str) -> None:
        self.log_path = workdir / "host.log"
        self._log = self.log_path.open("wb")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.visibility_runner", db_url, *extra],
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=REPO,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        assert line.startswith("READY "), self.text()[-3000:]
        self.port = int(line.split()[1])

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.text().splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                out.append(doc)
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)


@pytest.fixture
def host_factory(db_url: str, tmp_path: Path) -> Iterator[Callable[..., Host]]:
    migrate(db_url)
    started: list[Host] = []

    def start(*extra: str) -> Host:
        h = Host(db_url, tmp_path, *extra)
        started.append(h)
        return h

    yield start
    for h in started:
        h.stop()


def request(db_url: str, fam: Any, scope: str, *, tell: bool = True) -> None:
    backend = open_backend(db_url)
    try:
        with backend.transaction() as conn:
            fam.request(conn, scope)
    finally:
        backend.dispose()
    if tell:
        notify(db_url, fam.name)


def wait_for(predicate: Callable[[], Any], what: str, limit: float = 90.0) -> Any:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def http(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with opener.open(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def metric(port: int, name: str, family: str) -> float | None:
    _, body = http(port, "/metrics")
    m = re.search(rf'^{name}{{family="{family}"}} ([0-9.e+-]+)$', body.decode(), re.M)
    return float(m.group(1)) if m else None


def failure_of(h: Host, family: str) -> dict[str, Any] | None:
    for r in h.records():
        if r.get("msg") == "invocation failed" and r.get("family") == family:
            return r
    return None


def test_processor_logs_and_failure_record(host_factory: Callable[..., Host], db_url: str) -> None:
    h = host_factory()
    request(db_url, fams.vis_fail, "s1")
    failure = wait_for(lambda: failure_of(h, "vis-fail"), "the failure record")
    recs = [r for r in h.records() if r.get("family") == "vis-fail"]

    (own,) = [r for r in recs if r.get("logger") == "tests.visibility"]
    assert own["level"] == "INFO" and own["msg"] == "processing s1"
    assert own["family"] == "vis-fail" and own["binding"] == "vis-fail"
    assert own["scope"] == "s1" and own["request_generation"] == 1
    assert own["term"] >= 1 and own["worker_id"] == failure["worker_id"]
    assert not [r for r in recs if "debug detail" in str(r.get("msg"))]  # host level is INFO
    by_msg = {r.get("msg"): r for r in recs}
    for line, level in (
        ("plain print line", "INFO"),
        ("stray stderr line", "WARNING"),
        ("raw fd 2 line", "WARNING"),
    ):
        assert by_msg[line]["level"] == level, line
        assert all(by_msg[line][f] == own[f] for f in FIELDS), line

    assert failure["error_code"] == "failure"
    assert failure["exception_type"] == "RuntimeError"
    frames = failure["frames"]
    assert frames and frames[-1]["function"] == "vis_fail"
    assert frames[-1]["file"].endswith("visibility_families.py") and frames[-1]["line"] > 0
    assert all(failure[f] == own[f] for f in FIELDS if f != "binding")
    assert "withheld" in failure["error"] and fams.SECRET_TEXT not in failure["error"]
    assert fams.SECRET_TEXT not in h.text()  # nowhere in the host's log


def test_opted_in_family_logs_the_message(host_factory: Callable[..., Host], db_url: str) -> None:
    h = host_factory()
    request(db_url, fams.vis_optin, "s1")
    failure = wait_for(lambda: failure_of(h, "vis-optin"), "the failure record")
    assert failure["exception_type"] == "RuntimeError"
    assert failure["error"] == "an opted-in message"


def test_chatty_processor_is_bounded(host_factory: Callable[..., Host], db_url: str) -> None:
    h = host_factory()
    request(db_url, fams.vis_chatty, "s1")

    def dropped() -> dict[str, Any] | None:
        for r in h.records():
            if r.get("msg") == "worker log lines dropped (rate limit)":
                return r
        return None

    note = wait_for(dropped, "the dropped-lines note")
    assert note["family"] == "vis-chatty" and note["dropped"] > 0
    lines = [r for r in h.records() if str(r.get("msg", "")).startswith("chatty line")]
    assert 0 < len(lines) < 20000
    assert max(len(line) for line in h.text().splitlines()) < 20000  # the 50 kB line was cut


def test_hung_processor_grows_oldest_running_and_unacked_matches_status(
    host_factory: Callable[..., Host], db_url: str
) -> None:
    h = host_factory()
    assert metric(h.port, "apsup_oldest_running_seconds", "vis-hang") == 0.0
    request(db_url, fams.vis_hang, "s1")
    first = wait_for(
        lambda: (metric(h.port, "apsup_oldest_running_seconds", "vis-hang") or 0) > 0.5 or None,
        "a running vis-hang invocation",
    )
    assert first
    a = metric(h.port, "apsup_oldest_running_seconds", "vis-hang")
    time.sleep(2.5)
    b = metric(h.port, "apsup_oldest_running_seconds", "vis-hang")
    assert a is not None and b is not None and b >= a + 2.0

    # a second request the host cannot start (budget 1 is taken) and, on SQLite, is not told
    # about: `apsup status` reads it from the database; the gauge must show the same number
    request(db_url, fams.vis_hang, "stranded", tell=False)
    out = subprocess.run(
        [sys.executable, "-m", "apsup.cli", "status", "--db", db_url, "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=True,
    ).stdout
    view = json.loads(out)
    fam_views = [f for f in _families(view) if f.get("family", f.get("name")) == "vis-hang"]
    assert fam_views and fam_views[0]["unacknowledged"] == 2, out
    # scrapes read the database at most twice a second: the next one shows the same number
    wait_for(
        lambda: metric(h.port, "apsup_unacknowledged_requests", "vis-hang") == 2,
        "the gauge to agree with apsup status",
        limit=10,
    )


def _families(view: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    if isinstance(view, dict):
        if "unacknowledged" in view:
            found.append(view)
        for key, value in view.items():
            if isinstance(value, dict) and "unacknowledged" in value:
                found.append({"name": key, **value})
            else:
                found.extend(_families(value))
    elif isinstance(view, list):
        for item in view:
            found.extend(_families(item))
    return found


def test_head_on_health_endpoints(host_factory: Callable[..., Host]) -> None:
    h = host_factory()
    for path in ("/healthz", "/readyz", "/metrics", "/status"):
        code, body = http(h.port, path, method="HEAD")
        assert code == 200, path
        assert body == b""
    code, _ = http(h.port, "/nope", method="HEAD")
    assert code == 404


def test_success_line_at_debug(host_factory: Callable[..., Host], db_url: str) -> None:
    h = host_factory("LOG_LEVEL=DEBUG")
    request(db_url, fams.vis_manual, "ok1")

    def success() -> dict[str, Any] | None:
        for r in h.records():
            if r.get("msg") == "invocation succeeded" and r.get("scope") == "ok1":
                return r
        return None

    rec = wait_for(success, "the debug success record")
    assert rec["level"] == "DEBUG" and rec["family"] == "vis-manual"
    assert rec["request_generation"] == 1 and rec["worker_id"] and rec["duration"] >= 0
    assert rec["trigger"] == "request"
