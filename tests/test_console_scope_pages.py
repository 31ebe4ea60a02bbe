"""The console's per-Scope page and search: deep-linkable, escaped, read from durable state.

A real listener (``HealthServer``) over a real database with a ``ClusterProvider``: Scopes
requested through the public API, a failure recorded the way the leader records it. Search
finds a Scope by exact id and by prefix within one family; a Scope's page shows its
generations, its failure (redacted), what it waits for, and links back; every id is escaped.
"""

from __future__ import annotations

import html
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from apsup.observability.cluster import ClusterProvider
from apsup.observability.health import HealthServer
from apsup.registry import Registry, family
from apsup.store import operator_state

HOSTILE = "alpha.<script>alert(1)</script>\"'&"
registry = Registry()


def _snapshot() -> Any:
    return {"role": "all", "mode": "global", "supervisors": [], "heartbeat_age": 0.0}


@family("scope-pages", max_workers=1, registry=registry)
def scope_pages(scope_id: str, ctx: Any) -> None: ...


@pytest.fixture
def listener(backend: Any, db_url: str) -> Iterator[str]:
    with backend.transaction() as conn:
        for scope in ("alpha.1", "alpha.2", "beta", HOSTILE):
            scope_pages.request(conn, scope)
        now = backend.now()
        operator_state.record_failure(
            conn,
            scope_pages.binding_name,
            "alpha.1",
            failures=3,
            error_type="RuntimeError",
            error="cannot connect: password hunter2 refused",
            at=now,
            next_attempt_at=now + timedelta(minutes=2),
        )
    cluster = ClusterProvider(backend, db_url, lease_seconds=15.0)
    server = HealthServer(status=_snapshot,
                          cluster=cluster)  # fmt: skip
    server.start()
    try:
        yield f"http://127.0.0.1:{server.port}/"
    finally:
        server.stop()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _q(**kw: str) -> str:
    return urllib.parse.urlencode(kw)


def test_search_finds_by_exact_id_and_prefix(listener: str) -> None:
    code, page = _get(listener + "search?" + _q(family="scope-pages", q="alpha"))
    assert code == 200
    assert "alpha.1" in page and "alpha.2" in page and "beta" not in page.split("<h2>")[-1]
    assert 'href="scope?family=scope-pages&amp;id=alpha.1"' in page  # links to each Scope
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)" in page
    code, page = _get(listener + "search?" + _q(family="scope-pages", q="beta"))
    assert code == 200 and ">beta</a>" in page
    code, page = _get(listener + "search?" + _q(family="scope-pages", q="gamma"))
    assert code == 200 and "no Scope has this id or prefix" in page
    code, page = _get(listener + "search?" + _q(family="no-such", q="alpha"))
    assert "no family no-such in this cluster" in page
    code, _ = _get(listener + "search")
    assert code == 400


def test_a_scope_page_shows_its_generations_and_its_failure_redacted(listener: str) -> None:
    code, page = _get(listener + "scope?" + _q(family="scope-pages", id="alpha.1"))
    assert code == 200
    assert "requested / handled</th><td>1 / 0" in page
    assert "waiting to retry at" in page and "consecutive failures</th><td>3" in page
    assert "cannot connect" in page and "hunter2" not in page
    assert 'data-source="scope-main?family=scope-pages&amp;id=alpha.1"' in page  # refreshes
    code, main = _get(listener + "scope-main?" + _q(family="scope-pages", id="alpha.2"))
    assert code == 200 and "requested, waiting for a Worker" in main and "<html" not in main
    code, page = _get(listener + "scope?" + _q(family="scope-pages", id=HOSTILE))
    assert code == 200 and "<script>alert" not in page and "&lt;script&gt;" in page
    code, page = _get(listener + "scope?" + _q(family="scope-pages", id="never"))
    assert "unknown: never requested or marked dirty" in page


def test_the_cluster_page_links_every_failing_scope(listener: str) -> None:
    code, page = _get(listener)
    assert code == 200
    assert 'href="scope?family=scope-pages&amp;id=alpha.1"' in page
    assert '<form class="search" action="search" method="get">' in page
    assert "hunter2" not in page


TOKEN = "console-token-for-tests-0123456789"


@pytest.fixture
def guarded(backend: Any, db_url: str, listener: str) -> Iterator[tuple[str, HealthServer]]:
    """A second listener over the same database with a console credential and the family."""
    from apsup.observability.console_auth import ConsoleAuth

    cluster = ClusterProvider(
        backend, db_url, lease_seconds=15.0, families={scope_pages.name: scope_pages}
    )
    server = HealthServer(status=_snapshot,
                          cluster=cluster, auth=ConsoleAuth(TOKEN))  # fmt: skip
    server.start()
    try:
        yield f"http://127.0.0.1:{server.port}/", server
    finally:
        server.stop()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def _post(url: str, form: dict[str, str], cookie: str = "") -> tuple[int, dict[str, str], str]:
    data = urllib.parse.urlencode(form).encode()
    req = urllib.request.Request(url, data=data, method="POST")
    if cookie:
        req.add_header("Cookie", cookie)
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def _get_with(url: str, cookie: str) -> str:
    req = urllib.request.Request(url, headers={"Cookie": cookie})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read().decode()


def _state(backend: Any, scope: str) -> Any:
    with backend.read() as conn:
        return operator_state.scope_state(conn, scope_pages.binding_name, scope)


def test_actions_need_a_session_and_its_csrf_token(
    guarded: tuple[str, HealthServer], backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    import logging
    import re

    caplog.set_level(logging.INFO, logger="apsup")
    url, _ = guarded
    scope_url = url + "scope?" + _q(family="scope-pages", id="alpha.2")
    # Without a session: no buttons, and a forged post changes nothing.
    page = _get(scope_url)[1]
    assert "log in to act" in page and 'action="action"' not in page
    code, _, _ = _post(url + "action", {"action": "park", "family": "scope-pages",
                                        "scope": "alpha.2", "csrf": "x"})  # fmt: skip
    assert code == 403 and _state(backend, "alpha.2") is None
    # A wrong token is refused; the right one opens a session (HttpOnly, SameSite=Strict).
    assert _post(url + "login", {"token": "wrong-token-wrong-token"})[0] == 401
    code, headers, _ = _post(url + "login", {"token": TOKEN})
    assert code == 303
    assert "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]
    cookie = headers["Set-Cookie"].split(";", 1)[0]
    page = _get_with(scope_url, cookie)
    (csrf,) = set(re.findall(r'name="csrf" value="([^"]+)"', page))
    assert 'data-action="park"' in page and 'data-action="stop"' in page
    # The session without its CSRF token (a cross-site form) is refused.
    form = {"action": "park", "family": "scope-pages", "scope": "alpha.2", "back": "scope?x"}
    assert _post(url + "action", {**form, "csrf": "forged"}, cookie)[0] == 403
    assert _state(backend, "alpha.2") is None
    # With both: the same fenced write as `apsup scopes park`, echoed on the next page.
    code, headers, _ = _post(url + "action", {**form, "csrf": csrf}, cookie)
    assert code == 303 and headers["Location"] == "scope?x"
    assert _state(backend, "alpha.2").parked
    page = _get_with(scope_url, cookie)
    assert "parked; it is not dispatched until unparked" in page  # the flash message
    assert 'data-action="unpark"' in page
    # Retry all failing: alpha.1 (failing, not parked) gets its retry asked.
    _post(url + "action", {"action": "retry-failing", "family": "scope-pages", "csrf": csrf,
                           "back": "https://elsewhere.example/"}, cookie)  # fmt: skip
    assert _state(backend, "alpha.1").retry_requested
    # An unknown Scope is refused with the CLI's message, nothing written.
    _post(url + "action", {**form, "scope": "nope", "csrf": csrf}, cookie)
    assert "park refused: family 'scope-pages' has no Scope 'nope'" in html.unescape(
        _get_with(url, cookie)
    )
    logged = [r for r in caplog.records if r.getMessage() == "console action"]
    assert [getattr(r, "action", None) for r in logged] == ["park", "retry-failing", "park"]
    assert all(getattr(r, "who", "") == "console session from 127.0.0.1" for r in logged)
    assert TOKEN not in caplog.text
    # Log out: the cookie no longer acts.
    assert _post(url + "logout", {"csrf": csrf}, cookie)[0] == 303
    assert _post(url + "action", {**form, "action": "unpark", "csrf": csrf}, cookie)[0] == 403


def test_beyond_loopback_the_console_needs_the_credential(
    guarded: tuple[str, HealthServer], listener: str
) -> None:
    from apsup.observability.health import Request

    _, server = guarded
    far = Request(client="203.0.113.7")
    code, _, body = server.respond("/", "", {}, far)
    assert code == 200 and b"Log in to act" in body and b"alpha.1" not in body
    assert server.respond("/cluster", "", {}, far)[0] == 401
    bearer = Request(client="203.0.113.7", authorization=f"Bearer {TOKEN}")
    assert server.respond("/cluster", "", {}, bearer)[0] == 200
    assert server.respond("/healthz", "", {}, far)[0] == 200  # probes are not the console
    # Without a credential configured: loopback only, and one line saying what to set.
    plain = HealthServer(status=_snapshot,
                         cluster=server.cluster)  # fmt: skip
    code, _, body = plain.respond("/scope", "", {"family": "scope-pages", "id": "alpha.1"}, far)
    assert code == 403 and b"CONSOLE_TOKEN_FILE" in body and b"alpha.1" not in body
    assert plain.respond("/metrics", "", {}, far)[0] == 404  # (no registry here) not refused


def _outward_address() -> str | None:
    """This machine's first non-loopback IPv4 address (a client connecting to it is not a
    loopback client), or None."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
            address = str(s.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_status_url_sends_the_console_token_beyond_loopback(
    backend: Any, db_url: str, tmp_path: Any
) -> None:
    """``apsup status --url`` of a replica reached beyond loopback: refused without the
    token, with one line saying what to pass; with ``--token-file`` (or the replicas' own
    CONSOLE_TOKEN_FILE in the environment) it prints the cluster view."""
    import os
    import subprocess
    import sys

    import orjson

    from apsup.config import DEFAULT_PREFIX
    from apsup.observability.console_auth import ConsoleAuth

    address = _outward_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    with backend.transaction() as conn:
        scope_pages.request(conn, "alpha.1")
    cluster = ClusterProvider(backend, db_url, lease_seconds=15.0)
    server = HealthServer(status=_snapshot, cluster=cluster, auth=ConsoleAuth(TOKEN),
                          host=address)  # fmt: skip
    server.start()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(DEFAULT_PREFIX)}

    def status(*extra: str, **more_env: str) -> subprocess.CompletedProcess[str]:
        url = f"http://{address}:{server.port}"
        return subprocess.run(
            [sys.executable, "-m", "apsup.cli", "status", "--url", url, "--json", *extra],
            capture_output=True, text=True, timeout=60, env={**env, **more_env},
        )  # fmt: skip

    try:
        refused = status()
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
        assert "HTTP 401" in refused.stderr and "--token-file" in refused.stderr
        shown = status("--token-file", str(token_file))
        assert shown.returncode == 0, shown.stderr
        assert scope_pages.binding_name in orjson.loads(shown.stdout)["families"]
        from_env = status(**{DEFAULT_PREFIX + "CONSOLE_TOKEN_FILE": str(token_file)})
        assert from_env.returncode == 0, from_env.stderr
        bad = status("--token-file", str(tmp_path / "missing"))
        assert bad.returncode == 2 and bad.stderr.startswith("apsup status: --token-file: ")
        assert TOKEN not in refused.stderr + shown.stderr + bad.stderr
    finally:
        server.stop()
