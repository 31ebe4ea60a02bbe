"""A term is established only when the core is restored: a failed establishment never leaves a
leader that renews its Lease, reports ready and dispatches nothing (both backends).

The fault is real: the binding-state table is renamed away before the host claims, so the fenced
load of the establishment fails with the database's own error; it is renamed back later. While
it is away the host holds (or competes for) the Lease but is never reported ``ok``; once it is
back the pending request is handled within a bounded time. On MySQL a term that keeps failing is
released (and claimed again with a new generation) so that a standby could take over.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from apsup.store import migrate, open_backend
from apsup.supervisor.host import LeasePolicy
from apsup.supervisor.runtime import Runtime
from tests import liveness_families as lf
from tests.liveness_support import (
    BINDING_STATES,
    cycle_for,
    cycle_until,
    handled,
    live_host,
    readiness,
    rename_table,
    request,
)
from tests.replicas.support import http_get, running, settings_for, wait_for

pytestmark = pytest.mark.timeout(120)


def test_failed_establishment_is_retried_and_never_reported_ready(
    db_url: str, tmp_path: Path
) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    try:
        g = request(backend, lf.live_work, "ok.1")
        rename_table(db_url, BINDING_STATES, "live_moved_states")
        with live_host(db_url, [lf.live_work], tmp_path, lease=LeasePolicy(3.0, 1.0, 0.5)) as b:
            host = b.host
            sup = host.supervisors[0]
            generations: set[int] = set()
            errors: set[str] = set()
            held = 0

            def not_ready_while_broken() -> None:
                nonlocal held
                status = readiness(host)
                assert status["status"] != "ok", status  # a leader that does not dispatch
                assert sup.core is None and not b.pool.running()
                if sup.term is not None:
                    held += 1
                    generations.add(sup.term.generation)
                if sup.establish_error is not None:
                    errors.add(sup.establish_error)

            cycle_for(host, 8.0 if backend.name == "mysql" else 3.0, not_ready_while_broken)
            assert held > 0, "the host never held the Lease while the fault lasted"
            assert any("load" in e for e in errors), errors
            if backend.name == "mysql":
                # Released after repeated failures and claimed again: a new generation.
                assert len(generations) >= 2, generations
            assert not handled(backend, lf.live_work, "ok.1", g)

            rename_table(db_url, "live_moved_states", BINDING_STATES)
            t0 = time.monotonic()
            cycle_until(
                host, lambda: handled(backend, lf.live_work, "ok.1", g), 30, "request handled"
            )
            recovered = time.monotonic() - t0
            assert sup.established
            cycle_until(host, lambda: readiness(host)["status"] == "ok", 10, "ready")
            print(
                f"\n{backend.name}: {held} held-but-not-ready samples, {len(generations)} "
                f"generation(s) during the fault; request handled {recovered:.2f}s after repair"
            )
    finally:
        backend.dispose()


def test_readyz_over_http_is_not_ok_until_the_term_is_established(db_url: str) -> None:
    """The same fault on a real Runtime, read through ``/readyz`` over HTTP."""
    migrate(db_url)
    backend = open_backend(db_url)
    try:
        g = request(backend, lf.live_work, "ok.http")
        rename_table(db_url, BINDING_STATES, "live_moved_states")
        repaired = False
        try:
            runtime = Runtime(settings_for(db_url, registry=lf.registry), lf.registry)
            with running(runtime):
                port = runtime.http_port
                assert port is not None
                deadline = time.monotonic() + 3.0
                held_not_ready = []
                while time.monotonic() < deadline:
                    code, body = http_get(port, "/readyz")
                    assert body["status"] != "ok", body
                    work = body["families"].get(lf.live_work.name, {})
                    if code == 503 or "term not established" in str(work.get("reason")):
                        held_not_ready.append(body)
                    time.sleep(0.1)
                # Held but not established, and said so. (Between two attempts a host that gave
                # its term up after repeated failures is briefly a healthy standby.)
                assert held_not_ready, body
                rename_table(db_url, "live_moved_states", BINDING_STATES)
                repaired = True
                wait_for(
                    lambda: handled(backend, lf.live_work, "ok.http", g), 30, "request handled"
                )
                wait_for(lambda: http_get(port, "/readyz")[1]["status"] == "ok", 30, "ready")
        finally:
            if not repaired:
                rename_table(db_url, "live_moved_states", BINDING_STATES)
    finally:
        backend.dispose()
