"""The forkserver dies (kill -9) while Workers run: the host adopts them, confirms their exits,
frees their budget slots and redispatches their keys; nothing stays "unconfirmed"."""

from __future__ import annotations

import os
import signal

import pytest
from prometheus_client import generate_latest

from apsup.observability.health import Heartbeat
from apsup.observability.metrics import SupervisorMetrics
from apsup.supervisor.runtime import HostObserver
from tests.acceptance.families import configure
from tests.acceptance.harness import handled, pid_alive, request, scope_events, set_flag

pytestmark = pytest.mark.timeout(240)


def _started(store, fam, scope: str) -> list[dict]:
    return scope_events(store, fam, scope)


def test_forkserver_kill_does_not_strand_running_workers(hosts, store):
    fam = configure("acc-manual", disabled=True, max_workers=2)
    host = hosts.live_host([fam])
    metrics = SupervisorMetrics(families=[fam.name])
    observer = HostObserver(
        role="all", mode="global", metrics=metrics, heartbeat=Heartbeat(), lease_read_seconds=1
    )
    host.host.on_cycle = observer
    pool = host.bundle.pool
    scopes = ["gate.a", "gate.b"]
    for scope in scopes:
        request(store, fam, scope)
    host.run_until(lambda: all(_started(store, fam, s) for s in scopes), "both Workers started")
    # A newer request for each key arrives while its Worker runs: the key must be redispatched.
    for scope in scopes:
        request(store, fam, scope)
    fs_pid = pool.forkserver_pid
    assert fs_pid is not None
    os.kill(fs_pid, signal.SIGKILL)
    host.run_until(
        lambda: all(h.adopted for h in pool.running()) and len(pool.running()) == 2,
        "the host adopts both Workers of the dead forkserver",
    )
    workers = [e["pid"] for s in scopes for e in _started(store, fam, s)]
    assert all(pid_alive(p) for p in workers)  # they keep running: their work is not lost
    for scope in scopes:
        set_flag(store, f"gate:{scope}")
    host.run_until(lambda: all(handled(store, fam, s) for s in scopes), "both keys handled at G=2")
    for scope in scopes:
        evs = _started(store, fam, scope)
        assert [e["generation"] for e in evs] == [1, 2], evs  # confirmed, then redispatched
        assert all(e["outcome"] == "ok" for e in evs), evs
    host.run_until(lambda: not host.supervisor.running, "every budget slot is free")
    assert host.supervisor.unconfirmed() == {fam.name: 0}
    assert host.supervisor.failed[fam.name] == 0
    assert pool.forkserver_pid not in (None, fs_pid)  # a fresh forkserver launched the rest
    # Budget slots are really free: two new keys run at once under max_workers=2.
    request(store, fam, "ok.c")
    request(store, fam, "ok.d")
    host.run_until(
        lambda: handled(store, fam, "ok.c") and handled(store, fam, "ok.d"), "new keys run"
    )
    # Handled means acknowledged; the exit is confirmed a little later.
    host.run_until(lambda: not host.supervisor.running, "the new keys' exits are confirmed")
    host.cycle()
    status = observer.status()["supervisors"][0]["families"][fam.name]
    assert status["unconfirmed"] == 0 and status["running"] == 0
    scraped = generate_latest(metrics.registry).decode()
    assert f'apsup_workers_unconfirmed{{family="{fam.name}"}} 0.0' in scraped


def test_unconfirmed_workers_are_counted_per_family(hosts, store):
    """A stopped forkserver cannot report a killed Worker's exit: the Worker becomes
    "unconfirmed" (it keeps its budget slot) and status and metrics count it until the
    confirmation arrives."""
    fam = configure("acc-manual", disabled=True, max_workers=1, timeout=1.0)
    host = hosts.live_host([fam], grace_seconds=0.5)
    metrics = SupervisorMetrics(families=[fam.name])
    observer = HostObserver(
        role="all", mode="global", metrics=metrics, heartbeat=Heartbeat(), lease_read_seconds=1
    )
    host.host.on_cycle = observer
    pool = host.bundle.pool
    request(store, fam, "gate.z")  # waits for a flag that never comes: times out
    host.run_until(lambda: _started(store, fam, "gate.z"), "the Worker started")
    fs_pid = pool.forkserver_pid
    assert fs_pid is not None
    os.kill(fs_pid, signal.SIGSTOP)
    try:
        host.run_until(
            lambda: host.supervisor.unconfirmed() == {fam.name: 1}, "the Worker is unconfirmed"
        )
        host.cycle()
        status = observer.status()["supervisors"][0]["families"][fam.name]
        assert status["unconfirmed"] == 1 and status["running"] == 1  # its slot stays taken
        scraped = generate_latest(metrics.registry).decode()
        assert f'apsup_workers_unconfirmed{{family="{fam.name}"}} 1.0' in scraped
    finally:
        os.kill(fs_pid, signal.SIGCONT)
    host.run_until(lambda: not host.supervisor.running, "the exit is confirmed")
    host.cycle()
    assert observer.status()["supervisors"][0]["families"][fam.name]["unconfirmed"] == 0
