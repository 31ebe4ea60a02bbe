"""PostgreSQL restarted under load: the host recovers by itself and nothing accepted is lost.

A private server (a restart must not hit the other tests' server), a real host with real
Workers leading one family, and a publisher committing a request every 20 ms from another
thread. The server is stopped (fast shutdown: every session ended, as in a restart or a managed
failover) for 2 s and started again on the same port, twice. Asserted, as an operator meets it:

- every request whose commit succeeded is handled afterwards (the publisher's failed commits
  raised to it and are not counted);
- the host lost its term (it could not renew) and leads again with a newer generation, by
  itself, without a restart of its own;
- its listener reconnected after each restart, and wakes it again.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from apsup.store import open_backend
from apsup.supervisor.host import LeasePolicy
from tests.liveness_families import live_work
from tests.liveness_support import cycle_for, cycle_until, handled, live_host, request
from tests.pg_server import PostgresServer

pytestmark = [pytest.mark.postgresql, pytest.mark.timeout(240)]

RESTARTS = 2
DOWN = 2.0


def test_a_restarted_server_costs_no_accepted_request(tmp_path: Path) -> None:
    server = PostgresServer().start()
    try:
        url = server.admin_url
        lease = LeasePolicy(3.0, 1.0, 0.5)
        with live_host(url, [live_work], tmp_path, lease=lease) as bundle:
            host, backend = bundle.host, bundle.backend
            (sup,) = host.supervisors
            cycle_until(host, lambda: sup.term is not None, 30, "the first term")
            assert sup.term is not None
            first = sup.term.generation
            accepted: list[tuple[str, int]] = []
            refused = 0
            stop = threading.Event()

            def publish() -> None:
                nonlocal refused
                publisher = open_backend(url)
                try:
                    i = 0
                    while not stop.is_set():
                        scope = f"ok.restart-{i:05d}"
                        i += 1
                        try:
                            accepted.append((scope, request(publisher, live_work, scope)))
                        except Exception:
                            refused += 1  # the server is down: the caller sees it, as it should
                        time.sleep(0.02)
                finally:
                    publisher.dispose()

            thread = threading.Thread(target=publish, daemon=True)
            thread.start()
            try:
                cycle_for(host, 2.0)
                for _ in range(RESTARTS):
                    server.restart(down=DOWN)
                    cycle_until(host, lambda: sup.term is not None, 30, "a term again")
                    cycle_for(host, 2.0)
            finally:
                stop.set()
                thread.join(10)
            cycle_until(
                host,
                lambda: all(handled(backend, live_work, s, g) for s, g in accepted),
                90,
                "every accepted request handled",
            )
            assert sup.term is not None and sup.term.generation > first
            assert host.listener is not None and host.listener.connects >= 1 + RESTARTS
            assert refused > 0  # the outages were real
            print(
                f"\n[postgresql] {RESTARTS} restarts ({DOWN:g} s down): {len(accepted)} "
                f"requests accepted and handled, {refused} refused while down; generation "
                f"{first} -> {sup.term.generation}; listener connects {host.listener.connects}"
            )
    finally:
        server.stop()
