"""The console's per-Scope page and search: deep-linkable, escaped, read from durable state.

A real listener (``HealthServer``) over a real database with a ``ClusterProvider``: Scopes
requested through the public API, a failure recorded the way the leader records it. Search
finds a Scope by exact id and by prefix within one family; a Scope's page shows its
generations, its failure (redacted), what it waits for, and links back; every id is escaped.
"""

from __future__ import annotations

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
    server = HealthServer(status=lambda: {"role": "all", "mode": "global", "supervisors": []},
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
