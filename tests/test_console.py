"""The web console on the host's listener, in a real browser (headless Chromium).

A real host (``apsup run``) on both backends with a sleeping family and a failing one, a
failing Scope whose id is hostile markup. The console must show the family names, the running
Worker, the failing Scope with its redacted error, the hostile id as text (no script runs), pick
up a new failure on its own (no reload), log no console error, and load nothing but its own
listener's files. Without a browser the test is skipped, saying how to install one
(``apt-get install chromium``; CI installs it). ``APSUP_UPDATE_SCREENSHOT=1`` also writes
``docs/console.png``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from apsup.observability import console

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[1]
PREFIX = "POWERCONTEXT_SERVER_RUNTIME_"
HOSTILE = "<script>window.__pwned=1</script><img src=x onerror=window.__pwned=2>"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TOKEN = "browser-test-console-token-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _request(url: str, family: str, scope: str) -> None:
    import tests.console_app  # noqa: F401
    from apsup.registry import default_registry
    from apsup.store import open_backend
    from apsup.supervisor.control import notify

    fam = default_registry.get(family)
    backend = open_backend(url)
    try:
        with backend.transaction() as conn:
            fam.request(conn, scope)
    finally:
        backend.dispose()
    notify(url, family)


@pytest.fixture
def host(db_url: str, tmp_path: Path) -> Iterator[str]:
    from apsup.store import migrate

    migrate(db_url)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    env.update({PREFIX + "HTTP_PORT": str(port), "PYTHONPATH": str(REPO)})
    # The sleeping Worker is not waited for at the end (the default drain waits 30 s).
    env.update({PREFIX + "SHUTDOWN_DRAIN_SECONDS": "0", PREFIX + "SHUTDOWN_GRACE_SECONDS": "1"})
    token = tmp_path / "console-token"
    token.write_text(TOKEN + "\n")
    env[PREFIX + "CONSOLE_TOKEN_FILE"] = str(token)
    proc = subprocess.Popen(
        [sys.executable, "-m", "apsup.cli", "run", "--app", "tests.console_app", "--db", db_url],
        env=env,
        cwd=str(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(base + "readyz", timeout=2).read()
                break
            except Exception:
                assert proc.poll() is None, "the host exited"
                assert time.monotonic() < deadline, "the host never listened"
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_the_page_is_complete_without_javascript_and_escapes_everything() -> None:
    view = {
        "database": "mysql://db/app",
        "database_time": "2026-12-07T10:00:00Z",
        "host": {"role": "api"},
        "summary": {"status": "attention", "items": [{"kind": "failing", "text": HOSTILE}]},
        "replicas": [
            {
                "replica": HOSTILE,
                "state": "gone",
                "vanished_at": "2026-12-07T09:59:00Z",
                "host": "h<b>",
                "role": "background",
                "mode": "dedicated",
                "leads": ["artifact:f<b>"],
                "processes": [{}],
                "age": 60.0,
            }
        ],
        "events": [
            {"at": "t", "key": "global", "from": HOSTILE, "to": "r2", "term": 4, "why": "takeover"}
        ],
        "families": {
            "f<b>": {
                "status": "ok",
                "reason": None,
                "budget": 2,
                "running": 1,
                "ready": 0,
                "retry_wait": 1,
                "unacknowledged": 2,
                "policy": "disabled",
                "leader": {"key": "global", "generation": 3, "state": "active", "replica": "r1"},
                "running_scopes": [{"scope": HOSTILE, "age": 1.5}],
                "failing_count": 1,
                "failing": [{"scope": HOSTILE, "error": "<b>x</b>", "parked": False}],
                "history": [[100, 3, 1]],
            }
        },
    }
    html = console.page(view, None, now_minute=100).decode()
    assert "<script>window" not in html and "<img" not in html and "<b>" not in html
    assert "&lt;script&gt;" in html and "f&lt;b&gt;" in html
    assert html.count("<script") == 1 and 'src="console.js"' in html  # its own file only
    assert "http" not in html.split("<body>", 1)[1]  # no absolute link: works under a prefix
    assert 'class="ok"' in html and 'class="failed"' in html  # the chart's bars
    assert "r1 (Lease global, term 3)" in html  # the leader by replica name
    assert "gone since 2026-12-07T09:59:00Z" in html and "takeover" in html


def test_the_listener_serves_the_console_with_a_strict_policy(host: str) -> None:
    with urllib.request.urlopen(host, timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/html")
        assert resp.headers["Content-Security-Policy"] == "default-src 'self'"
        body = resp.read().decode()
    assert "console-sleep" in body and "console-fail" in body
    for name in console.STATIC:
        with urllib.request.urlopen(host + name, timeout=5) as resp:
            assert resp.status == 200 and resp.read()


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: apt-get install chromium")
def test_the_console_in_a_real_browser(host: str, db_url: str) -> None:
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    _request(db_url, "console-sleep", "napping")
    _request(db_url, "console-fail", HOSTILE)
    errors: list[str] = []
    requests: list[str] = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("request", lambda r: requests.append(r.url))
            page.on("dialog", lambda d: (errors.append(f"dialog {d.message}"), d.dismiss()))
            page.goto(host)
            page.evaluate("window.__same_page = 1")
            main = page.locator("#console")
            # The running Worker and the failing Scope (its error redacted), by refresh.
            main.get_by_text("napping").wait_for(timeout=30_000)
            main.get_by_text(HOSTILE).first.wait_for(timeout=30_000)
            text = main.inner_text()
            assert "console-sleep" in text and "console-fail" in text
            assert "console-boom for" in text and "pw-4421" not in text
            assert page.evaluate("window.__pwned === undefined")
            # A new failure appears without a reload.
            _request(db_url, "console-fail", "later-failure")
            main.get_by_text("console-boom for later-failure").wait_for(timeout=30_000)
            assert page.evaluate("window.__same_page") == 1
            # Without a session the Scope's page offers no action, and a forged post is
            # refused (403) with nothing written.
            page.get_by_role("link", name="later-failure").first.click()
            page.get_by_text("consecutive failures").wait_for(timeout=10_000)
            assert page.locator('button[data-action="retry"]').count() == 0
            status = page.evaluate(
                """async () => (await fetch("action", {method: "POST", body: new URLSearchParams(
                    {action: "retry", family: "console-fail", scope: "later-failure", csrf: "x"})
                })).status"""
            )
            assert status == 403
            # Log in with the credential, come back, retry from the page.
            page.get_by_role("link", name="log in to act").click()
            page.fill('input[name="token"]', TOKEN)
            page.get_by_role("button", name="Log in").click()
            page.get_by_text("log out").wait_for(timeout=10_000)
            page.get_by_role("link", name="later-failure").first.click()
            page.locator('button[data-action="retry"]').click()
            page.get_by_text("retry requested; the leader attempts it").wait_for(timeout=10_000)
            assert "hunter2" not in page.content() and TOKEN not in page.content()
            if os.environ.get("APSUP_UPDATE_SCREENSHOT"):
                page.screenshot(path=str(REPO / "docs" / "console.png"), full_page=True)
        finally:
            browser.close()
    refused = "Failed to load resource: the server responded with a status of 403"
    assert [e for e in errors if not e.startswith(refused)] == []
    assert len(errors) <= 1  # the forged post's 403, the only one
    assert all(u.startswith(host) for u in requests), requests
