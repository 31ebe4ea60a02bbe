"""Roles and modes of ``Runtime`` (RFC §8 "Roles and recovery", §9, acceptance 11).

- topology: ``all``/``api``/``background`` x ``global``/``dedicated`` x sqlite/mysql; SQLite
  accepts only ``all`` (a clear ConfigError otherwise, even for settings built by hand);
- SQLite ``global`` and ``dedicated`` run in one host process (dedicated: one Supervisor per
  family, each with its own ``artifact:<family>`` term, no child process), wake on the control
  channel (no polling) and serve health;
- MySQL ``api`` never claims a Lease and never dispatches; an accepted request is handled only
  once a background replica runs;
- MySQL ``background`` replicas: exactly one leader per key; the standby is healthy (``/readyz``
  200 ``standby``), keeps running, and never dispatches (every commit carries the leader's term);
- MySQL ``dedicated``: one Supervisor process per family competing for ``artifact:<family>``,
  a crashed child restarted, SIGTERM stops every child and confirms it, terms released;
- the launcher's child environment reproduces the effective settings exactly, and its restart
  delays double from 1 s to 60 s.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest
from sqlalchemy import event

from apsup.errors import ConfigError, HostConflictError
from apsup.registry import Registry, family
from apsup.store import open_backend
from apsup.supervisor.dedicated import DedicatedLauncher, _Child, child_env
from apsup.supervisor.runtime import Runtime, check_topology
from tests.replicas import families
from tests.replicas.cluster import Cluster, descendants
from tests.replicas.support import (
    FAST_BACKOFF,
    http_get,
    running,
    settings_for,
    wait_for,
)
from tests.replicas.support import (
    handled as _handled,
)
from tests.replicas.support import (
    request as _request,
)

pytestmark = pytest.mark.timeout(180)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _dedicated_children(pid: int) -> dict[str, int]:
    out = {}
    for child in descendants(pid):
        cmd = _cmdline(child)
        if "apsup.supervisor.dedicated" in cmd and "--family" in cmd:
            out[cmd.split("--family ", 1)[1].split()[0]] = child
    return out


# -- topology (no database) ---------------------------------------------------------------------


def test_topology_matrix_and_sqlite_accepts_only_role_all(tmp_path: Path) -> None:
    sqlite_url = f"sqlite:///{tmp_path / 'a.db'}"
    base = settings_for(sqlite_url)
    mysql_url = "mysql+pymysql://u@127.0.0.1:1/db"
    expected = {
        ("sqlite", "all", "global"): "host",
        ("sqlite", "all", "dedicated"): "host",
        ("mysql", "all", "global"): "host",
        ("mysql", "background", "global"): "host",
        ("mysql", "all", "dedicated"): "processes",
        ("mysql", "background", "dedicated"): "processes",
        ("mysql", "api", "global"): "api",
        ("mysql", "api", "dedicated"): "api",
    }
    for (kind, role, mode), topology in expected.items():
        url = sqlite_url if kind == "sqlite" else mysql_url
        s = dataclasses.replace(base, database_url=url, role=role, mode=mode)
        assert check_topology(s) == topology, (kind, role, mode)
    # Settings refuse a non-"all" role on SQLite at load time ...
    for role in ("api", "background"):
        with pytest.raises(ConfigError, match="SQLite"):
            settings_for(sqlite_url, role=role)
        # ... and the Runtime refuses settings built around that check.
        forged = dataclasses.replace(base, role=role)
        with pytest.raises(ConfigError, match="SQLite runs one host with role 'all'"):
            Runtime(forged, families.registry)
    with pytest.raises(ConfigError, match="unknown mode"):
        check_topology(dataclasses.replace(base, mode="grouped"))


# -- dedicated launcher units --------------------------------------------------------------------

reg = Registry()


@family("roles-interval", interval=30, max_workers=3, timeout=40, registry=reg)
def roles_interval(scope_id: str, ctx: object) -> None:  # pragma: no cover - never dispatched
    pass


@family("roles-cron", cron="0 2 * * *", timezone="Asia/Shanghai", max_workers=2, registry=reg)
def roles_cron(scope_id: str, ctx: object) -> None:  # pragma: no cover - never dispatched
    pass


@family("roles-disabled", max_workers=1, timeout=5, registry=reg)
def roles_disabled(scope_id: str, ctx: object) -> None:  # pragma: no cover - never dispatched
    pass


def test_child_environment_reproduces_the_effective_settings(tmp_path: Path) -> None:
    s = settings_for(
        "mysql+pymysql://user:secret@127.0.0.1:1/db",
        registry=reg,
        role="all",
        mode="dedicated",
        HTTP_PORT="9100",
        ROLES_INTERVAL_SCHEDULE_SECONDS="12.5",
        ROLES_CRON_MAX_WORKERS="7",
        ROLES_DISABLED_WORKER_TIMEOUT_SECONDS="9",
        LOG_LEVEL="WARNING",
    )
    from apsup.config import Settings

    base = {"PATH": "/bin", "POWERCONTEXT_SERVER_RUNTIME_STALE": "dropped"}
    for index, name in enumerate(sorted(s.families)):
        env = child_env(s, index, base)
        assert env["PATH"] == "/bin" and "POWERCONTEXT_SERVER_RUNTIME_STALE" not in env
        again = Settings.load(reg, env=env)
        assert (again.mode, again.role) == ("dedicated", "background")
        assert again.http_port == 9100 + 1 + index, name
        assert again.database_url == s.database_url
        for field in ("lease_seconds", "renew_seconds", "poll_seconds", "log_level"):
            assert getattr(again, field) == getattr(s, field)
        for fam in s.families.values():
            other = again.families[fam.name]
            assert (other.policy, other.max_workers, other.timeout) == (
                fam.policy,
                fam.max_workers,
                fam.timeout,
            )


def test_restart_delay_doubles_from_one_second_to_sixty_and_resets(tmp_path: Path) -> None:
    s = settings_for(f"sqlite:///{tmp_path / 'x.db'}", http=False)
    launcher = DedicatedLauncher(s, families.registry)
    child = _Child("replica-work", 0, tmp_path / "0.port")
    delays = []
    for _ in range(9):
        launcher._schedule_restart(child, now=1000.0, uptime=0.5)
        delays.append(child.next_start - 1000.0)
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    launcher._schedule_restart(child, now=2000.0, uptime=61.0)  # it ran fine for a while
    assert child.next_start - 2000.0 == 1


# -- SQLite: one host process ---------------------------------------------------------------------


@pytest.mark.backends("sqlite")
@pytest.mark.parametrize("mode", ["global", "dedicated"])
def test_sqlite_runs_every_supervisor_in_one_host_process(db_url: str, mode: str) -> None:
    Cluster.prepare(db_url)
    runtime = Runtime(settings_for(db_url, mode=mode), families.registry, backoff=FAST_BACKOFF)
    with running(runtime):
        host = runtime.host
        assert host is not None
        keys = sorted(s.key for s in host.supervisors)
        if mode == "global":
            assert keys == ["global"]
        else:
            assert keys == ["artifact:replica-side", "artifact:replica-work"]
        assert all(s.term is not None for s in host.supervisors)
        assert _dedicated_children(os.getpid()) == {}  # no per-family process on SQLite
        # A second host on the same file is refused: SQLite never runs multi-process.
        with pytest.raises(HostConflictError):
            Runtime(settings_for(db_url, mode=mode, http=False), families.registry).run()
        g1 = _request(db_url, "replica-work", "a")
        g2 = _request(db_url, "replica-side", "b")
        wait_for(
            lambda: (
                _handled(db_url, "replica-work", "a") >= g1
                and _handled(db_url, "replica-side", "b") >= g2
            ),
            what="both families handled",
        )
        port = runtime.http_port
        assert port is not None
        # Idle: the loop keeps beating (fresh /healthz) without touching the database.
        time.sleep(1.5)  # the last post-activity status count
        statements: list[str] = []
        engine = host.backend.engine
        listener = lambda *args: statements.append(args[2])  # noqa: E731
        event.listen(engine, "before_cursor_execute", listener)
        try:
            time.sleep(3)
        finally:
            event.remove(engine, "before_cursor_execute", listener)
        assert statements == [], statements
        assert http_get(port, "/healthz")[0] == 200
        code, body = http_get(port, "/readyz")
        assert code == 200 and body["status"] == "ok" and body["mode"] == mode
        assert sorted(s["key"] for s in body["supervisors"]) == keys
    backend = open_backend(db_url)
    try:
        rows = {r.supervisor_key: r for r in backend.lease_rows()}
    finally:
        backend.dispose()
    assert sorted(rows) == keys
    assert all(r.holder_id == "" for r in rows.values())  # released at shutdown


# -- MySQL: api / background / dedicated ----------------------------------------------------------


def _live(c: Cluster, key: str) -> object:
    view = c.lease(key)
    if view is None or not view.holder_id or view.expires_at is None:
        return None
    return view if view.expires_at > view.db_now else None


@pytest.mark.mysql_only
def test_api_role_never_claims_nor_dispatches(db_url: str) -> None:
    Cluster.prepare(db_url)
    api = Runtime(settings_for(db_url, role="api"), families.registry)
    with running(api):
        assert api.host is None
        port = api.http_port
        assert port is not None
        code, body = http_get(port, "/readyz")
        assert code == 200 and body["role"] == "api" and body["supervisors"] == []
        assert http_get(port, "/healthz")[0] == 200
        g = _request(db_url, "replica-work", "api-scope")
        time.sleep(2.5)  # several poll and renew intervals
        assert _handled(db_url, "replica-work", "api-scope") == 0
        backend = open_backend(db_url)
        try:
            assert backend.lease_rows() == []  # the api role never claims a Lease
        finally:
            backend.dispose()
        background = Runtime(
            settings_for(db_url, role="background"), families.registry, backoff=FAST_BACKOFF
        )
        with running(background):
            wait_for(
                lambda: _handled(db_url, "replica-work", "api-scope") >= g,
                what="the background replica to handle the request",
            )


@pytest.mark.mysql_only
def test_background_replicas_one_leader_and_a_healthy_standby(db_url: str, tmp_path: Path) -> None:
    Cluster.prepare(db_url)
    c = Cluster(db_url, tmp_path / "c")
    try:
        replicas = [c.start("background") for _ in range(2)]
        c.wait_ready(*replicas)
        leader = c.wait_leader()
        standby = next(r for r in replicas if r is not leader)
        for i in range(20):
            c.request("replica-work", f"r{i % 5}")
        c.wait_all_handled(timeout=60)
        time.sleep(3)  # > lease: the standby keeps running, unelected, and stays healthy
        assert standby.alive() and c.leader() is leader
        assert standby.port is not None and leader.port is not None
        code, body = http_get(standby.port, "/readyz")
        assert code == 200 and body["status"] == "standby"
        assert body["supervisors"][0]["leader"] is False
        assert http_get(standby.port, "/healthz")[0] == 200
        code, body = http_get(leader.port, "/readyz")
        assert code == 200 and body["status"] == "ok" and body["supervisors"][0]["leader"]
        # Only the leader dispatched: every business commit carries its term.
        rows = [r for r in c.journal() if r.kind == "commit"]
        assert rows and {r.holder_id for r in rows} == {leader.holder_id}
        for r in replicas:
            assert c.stop(r) == 0  # SIGTERM: graceful exit
        view = c.lease()
        assert view is not None and view.holder_id == ""  # the leader released its term
    finally:
        c.close()


@pytest.mark.mysql_only
def test_dedicated_one_process_per_family_restarted_and_stopped(
    db_url: str, tmp_path: Path
) -> None:
    Cluster.prepare(db_url)
    c = Cluster(db_url, tmp_path / "c", mode="dedicated")
    try:
        launchers = [c.start("background") for _ in range(2)]
        c.wait_ready(*launchers)
        children = {
            r.name: wait_for(
                lambda r=r: len(_dedicated_children(r.pid)) == 2 and _dedicated_children(r.pid),
                what="children",
            )
            for r in launchers
        }
        keys = ["artifact:replica-side", "artifact:replica-work"]
        views = {
            k: wait_for(lambda k=k: c.lease(k) and c.lease(k).holder_id and c.lease(k), what=k)
            for k in keys
        }
        # One leader per key across both replicas (two candidates per key, one Lease per key).
        assert {c.lease(k).generation for k in keys} == {1}  # type: ignore[union-attr]
        assert len({views[k].holder_id for k in keys}) == 2  # distinct Supervisor processes
        for i in range(6):
            c.request("replica-work", f"w{i}")
            c.request("replica-side", f"s{i}")
        c.wait_all_handled(timeout=60)
        # Ready once each child answers its status (a child restarted under load is down for
        # its restart: readiness says so, and comes back).
        _, body = wait_for(
            lambda: (got := http_get(launchers[0].port, "/readyz"))[0] == 200 and got,  # type: ignore[arg-type]
            timeout=30,
            what="the launcher ready",
        )
        assert sorted(s["key"] for s in body["supervisors"]) == keys
        # kill -9 one family's Supervisor process: the launcher restarts it.
        first = launchers[0]
        assert children[first.name]  # both children were up at start
        # Read the pids now: a child may have been restarted since (e.g. under heavy load).
        victim_family, victim = sorted(_dedicated_children(first.pid).items())[0]
        os.kill(victim, signal.SIGKILL)
        restarted = wait_for(
            lambda: (
                (p := _dedicated_children(first.pid).get(victim_family)) not in (None, victim) and p
            ),
            timeout=30,
            what="the child to be restarted",
        )
        assert restarted != victim
        # SIGTERM the launcher: every child stops, exits are confirmed, terms are released.
        kids = list(_dedicated_children(first.pid).values())
        assert c.stop(first) == 0
        for pid in kids:
            assert not os.path.exists(f"/proc/{pid}") or "apsup" not in _cmdline(pid)
        assert c.stop(launchers[1]) == 0

        def nothing_live() -> bool:
            # Released at shutdown, or (the killed child's term, which nobody could release)
            # expired within one lease: nothing stays live.
            for k in keys:
                view = c.lease(k)
                assert view is not None and view.expires_at is not None
                if not (view.holder_id == "" or view.expires_at <= view.db_now):
                    return False
            return True

        wait_for(nothing_live, timeout=c.lease_seconds + 10, what="every term released/expired")
    finally:
        c.close()
