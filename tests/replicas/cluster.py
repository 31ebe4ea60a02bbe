"""A local multi-replica cluster of real processes for the fault tests (mirrors
deploy/local-cluster.sh): N background replicas and M api replicas of ``tests.replicas.replica``
against one MySQL-compatible database, with short leases.

Every process started here carries ``REPLICA_TEST_TAG=<uuid>`` in its environment, inherited by
its forkserver and Workers (which run in their own sessions and may outlive a killed replica):
teardown kills exactly the processes carrying this cluster's tag, by pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, insert, select, text

from apsup.store import SqlBackend, intents, migrate, open_backend
from apsup.store.schema import intents as intents_table
from apsup.store.schema import leases
from tests.replicas import families

PREFIX = "POWERCONTEXT_SERVER_RUNTIME_"
REPO_ROOT = Path(__file__).resolve().parents[2]


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (from /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may contain spaces/parentheses
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            out.append(child)
            todo.append(child)
    return out


def tagged(tag: str) -> list[int]:
    """Pids of live processes whose environment carries ``REPLICA_TEST_TAG=tag``."""
    needle = f"REPLICA_TEST_TAG={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry))
    return found


@dataclass
class Replica:
    name: str
    role: str
    proc: subprocess.Popen[bytes]
    info_path: Path
    log_path: Path
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def holder_id(self) -> str | None:
        return self.info.get("holder_id")

    @property
    def port(self) -> int | None:
        return self.info.get("port")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass(frozen=True)
class LeaseView:
    holder_id: str
    generation: int
    expires_at: datetime | None
    db_now: datetime


def _accepted(conn: Any) -> list[Any]:
    """(family, scope, highest accepted G) for every Scope a test requested."""
    return list(
        conn.execute(
            select(
                families.accepted.c.family,
                families.accepted.c.scope_id,
                func.max(families.accepted.c.g),
            ).group_by(families.accepted.c.family, families.accepted.c.scope_id)
        ).all()
    )


#: Seconds the replicas together get to stop at teardown before they are killed.
TEARDOWN_SECONDS = 5.0


class Cluster:
    def __init__(
        self,
        url: str,
        workdir: Path,
        *,
        lease: float = 3.0,
        renew: float = 1.0,
        poll: float = 0.5,
        mode: str = "global",
        env: dict[str, str] | None = None,
    ) -> None:
        self.url = url
        self.workdir = workdir
        self.lease_seconds = lease
        self.renew_seconds = renew
        self.poll_seconds = poll
        self.mode = mode
        self.extra_env = dict(env or {})
        self.tag = uuid.uuid4().hex
        self.replicas: list[Replica] = []
        self._count = 0
        workdir.mkdir(parents=True, exist_ok=True)
        self.backend: SqlBackend = open_backend(url)

    # -- setup ------------------------------------------------------------------------------
    @staticmethod
    def prepare(url: str) -> None:
        migrate(url)
        families.create_tables(url)

    def env(self, role: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
        env.update(
            {
                PREFIX + "DATABASE_URL": self.url,
                PREFIX + "ARTIFACT_PROCESSING_ROLE": role,
                PREFIX + "ARTIFACT_PROCESSING_SUPERVISOR_MODE": self.mode,
                PREFIX + "LEASE_SECONDS": str(self.lease_seconds),
                PREFIX + "RENEW_SECONDS": str(self.renew_seconds),
                PREFIX + "POLL_SECONDS": str(self.poll_seconds),
                PREFIX + "SHUTDOWN_GRACE_SECONDS": "3",
                PREFIX + "HTTP_PORT": "0",
                PREFIX + "LOG_FORMAT": "json",
                "REPLICA_TEST_TAG": self.tag,
                "PYTHONPATH": os.pathsep.join(
                    p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
                ),
            }
        )
        env.update(self.extra_env)
        return env

    def start(
        self, role: str = "background", *args: str, env: dict[str, str] | None = None
    ) -> Replica:
        self._count += 1
        name = f"{role}-{self._count}"
        info = self.workdir / f"{name}.json"
        log = self.workdir / f"{name}.log"
        info.unlink(missing_ok=True)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.replicas.replica", "--info", str(info), *args],
                env={**self.env(role), **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=str(REPO_ROOT),
            )
        replica = Replica(name, role, proc, info, log)
        self.replicas.append(replica)
        return replica

    def wait_ready(self, *replicas: Replica, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for r in replicas:
            while not r.info_path.exists():
                if not r.alive():
                    raise AssertionError(f"{r.name} exited {r.proc.returncode}:\n{r.log_tail()}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"{r.name} not ready in {timeout}s:\n{r.log_tail()}")
                time.sleep(0.05)
            r.info = json.loads(r.info_path.read_text())

    # -- observation ------------------------------------------------------------------------
    def lease(self, key: str = "global") -> LeaseView | None:
        with self.backend.engine.connect() as conn:
            row = conn.execute(
                select(
                    leases.c.holder_id,
                    leases.c.supervisor_generation,
                    leases.c.expires_at,
                    self.backend.db_time_sql() if self.backend.name != "sqlite" else func.now(),
                ).where(leases.c.supervisor_key == key)
            ).first()
            conn.rollback()
        if row is None:
            return None
        return LeaseView(row[0], int(row[1]), row[2], row[3])

    def db_now(self) -> datetime:
        return self.backend.now()

    def leader(self, key: str = "global") -> Replica | None:
        view = self.lease(key)
        if view is None or view.expires_at is None or view.expires_at <= view.db_now:
            return None
        for r in self.replicas:
            if r.holder_id == view.holder_id and r.alive():
                return r
        return None

    def wait_leader(self, key: str = "global", timeout: float = 30.0) -> Replica:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.leader(key)
            if r is not None:
                return r
            time.sleep(0.05)
        raise AssertionError(f"no live leader for {key!r} within {timeout}s: {self.lease(key)}")

    def wait_generation_above(
        self, generation: int, key: str = "global", timeout: float = 30.0, step: float = 0.02
    ) -> LeaseView | None:
        """First observation of a live term newer than ``generation`` (None on timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            view = self.lease(key)
            if (
                view is not None
                and view.generation > generation
                and view.holder_id != ""
                and view.expires_at is not None
            ):
                return view
            time.sleep(step)
        return None

    def journal(self) -> list[Any]:
        with self.backend.read() as conn:
            return families.read_journal(conn)

    def commits_since(self, generation: int, key: str = "global") -> int:
        with self.backend.read() as conn:
            return int(
                conn.execute(
                    select(func.count()).where(
                        families.journal.c.kind == "commit",
                        families.journal.c.supervisor_key == key,
                        families.journal.c.generation >= generation,
                    )
                ).scalar_one()
            )

    def stamp_takeover(self, key: str, view: LeaseView) -> int:
        with self.backend.transaction() as conn:
            return families.stamp_takeover(conn, key, view.generation, view.holder_id)

    def request(self, family: str, scope_id: str) -> int:
        fam = families.lookup(family)
        with self.backend.transaction() as conn:
            g = fam.request(conn, scope_id)
            conn.execute(insert(families.accepted).values(family=fam.name, scope_id=scope_id, g=g))
        return g

    def unhandled(self) -> list[tuple[str, str, int, int]]:
        """Accepted requests whose generation is not acknowledged yet."""
        with self.backend.read() as conn:
            acc = _accepted(conn)
            out = []
            for fam_name, scope, g in acc:
                row = intents.get(conn, families.lookup(fam_name).binding_name, scope)
                handled = 0 if row is None else row.handled_generation
                if handled < int(g):
                    out.append((fam_name, scope, int(g), handled))
        return out

    def wait_all_handled(self, timeout: float = 90.0) -> float:
        t0 = time.monotonic()
        deadline = t0 + timeout
        left: list[Any] = []
        while time.monotonic() < deadline:
            left = self.unhandled()
            if not left:
                return time.monotonic() - t0
            time.sleep(0.2)
        raise AssertionError(f"{len(left)} accepted request(s) never handled: {left[:10]}")

    def uncovered(self) -> list[str]:
        """Accepted (family, scope, g) without a business commit for some G >= g."""
        with self.backend.read() as conn:
            acc = _accepted(conn)
            done = {
                (f, s): int(g)
                for f, s, g in conn.execute(
                    select(
                        families.journal.c.family,
                        families.journal.c.scope_id,
                        func.max(families.journal.c.g),
                    )
                    .where(families.journal.c.kind == "commit")
                    .group_by(families.journal.c.family, families.journal.c.scope_id)
                ).all()
            }
        return [f"{f}/{s} G={g}" for f, s, g in acc if done.get((f, s), 0) < int(g)]

    def event_counts(self) -> dict[str, int]:
        with self.backend.read() as conn:
            rows = conn.execute(
                select(families.events.c.kind, func.count()).group_by(families.events.c.kind)
            ).all()
        return {k: int(n) for k, n in rows}

    def intent_totals(self) -> tuple[int, int]:
        with self.backend.read() as conn:
            req, handled = conn.execute(
                select(
                    func.coalesce(func.sum(intents_table.c.requested_generation), 0),
                    func.coalesce(func.sum(intents_table.c.handled_generation), 0),
                )
            ).one()
        return int(req), int(handled)

    # -- faults -----------------------------------------------------------------------------
    def process_tree(self, replica: Replica) -> list[int]:
        return [replica.pid, *descendants(replica.pid)]

    @staticmethod
    def signal_all(pids: list[int], sig: int) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def kill9(self, replica: Replica) -> None:
        os.kill(replica.pid, signal.SIGKILL)
        replica.proc.wait(10)

    # -- teardown ---------------------------------------------------------------------------
    def stop(self, replica: Replica, timeout: float = 20.0) -> int | None:
        if replica.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(replica.pid, signal.SIGCONT)
                replica.proc.send_signal(signal.SIGTERM)
            try:
                replica.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                replica.proc.kill()
                replica.proc.wait(10)
        return replica.proc.returncode

    def close(self) -> None:
        for r in self.replicas:
            if r.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(r.pid, signal.SIGCONT)
                    r.proc.send_signal(signal.SIGTERM)
        # The tests are over: what a replica does on SIGTERM is tested where it matters
        # (graceful drain, handover); here it gets a few seconds, then SIGKILL.
        deadline = time.monotonic() + TEARDOWN_SECONDS
        for r in self.replicas:
            self.stop(r, timeout=max(0.1, deadline - time.monotonic()))
        # Workers and forkservers of killed replicas carry the tag: kill exactly those.
        for _ in range(3):
            left = tagged(self.tag)
            if not left:
                break
            self.signal_all(left, signal.SIGCONT)
            self.signal_all(left, signal.SIGKILL)
            time.sleep(0.2)
        self.backend.dispose()


def db_seconds(a: datetime, b: datetime) -> float:
    return (b - a).total_seconds()


def server_processlist(backend: SqlBackend) -> list[Any]:
    with backend.engine.connect() as conn:
        return list(conn.execute(text("SELECT id, info FROM information_schema.processlist")))
