"""The fault campaign's moving parts: a request stream, a readiness sampler, and a nemesis.

They drive a ``tests.replicas.cluster.Cluster`` of real replica processes (reused, not copied):
on MySQL its replicas reach the server through a :class:`FaultProxy`, while the test process
observes the database directly; on SQLite one host shares the database file with the test.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apsup.supervisor.control import notify
from tests.faults.proxy import FaultProxy
from tests.faults.sqlite_faults import fill, write_lock_held
from tests.replicas import families
from tests.replicas.cluster import PREFIX, Cluster, Replica, descendants
from tests.replicas.support import http_get


class ProxiedCluster(Cluster):
    """A Cluster whose replicas use ``replica_url`` (through the proxy); the test's own
    observations and requests use the direct URL."""

    def __init__(self, url: str, replica_url: str, workdir: Path, **kwargs: Any) -> None:
        super().__init__(url, workdir, **kwargs)
        self.replica_url = replica_url

    def env(self, role: str) -> dict[str, str]:
        env = super().env(role)
        env[PREFIX + "DATABASE_URL"] = self.replica_url
        return env


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, pgid) of ``pid``, None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().decode(errors="replace").rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[2])


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def forkserver_of(replica: Replica) -> int | None:
    """The replica's Worker zygote: its direct child in the replica's own process group
    (Workers lead their own groups) that runs ``apsup.workers.zygote``."""
    for pid in descendants(replica.pid):
        st = _stat(pid)
        if (
            st is not None
            and st[0] == replica.pid
            and st[1] == replica.pid
            and b"apsup.workers.zygote" in _cmdline(pid)
        ):
            return pid
    return None


def workers_of(replica: Replica) -> list[int]:
    """Live Workers of the replica (each leads its own process group)."""
    out = []
    for pid in descendants(replica.pid):
        st = _stat(pid)
        if st is not None and st[1] == pid:
            out.append(pid)
    return out


class RequestStream(threading.Thread):
    """A steady stream of accepted requests (each journalled in ``replica_accepted``)."""

    def __init__(self, cluster: Cluster, interval: float, scopes: int, seed: int) -> None:
        super().__init__(name="campaign-requests", daemon=True)
        self.cluster = cluster
        self.interval = interval
        self.scopes = scopes
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.accepted = 0
        self.refused = 0

    def run(self) -> None:
        sqlite = self.cluster.backend.name == "sqlite"
        while not self.stop.wait(self.interval):
            try:
                self.cluster.request(families.work.name, f"s{self.rng.randrange(self.scopes)}")
                self.accepted += 1
            except Exception:
                self.refused += 1  # e.g. the database file is locked by the nemesis
                continue
            if sqlite:
                with contextlib.suppress(OSError):
                    notify(self.cluster.url, families.work.name)


@dataclass
class Sample:
    at: float
    replica: str
    holder: str | None
    status: str
    leader: bool
    generation: int | None


class Sampler(threading.Thread):
    """Every ``interval``: each live replica's ``/readyz``, and the Lease; a newer generation is
    journalled as a takeover so a later commit of an older term shows as a fencing violation."""

    def __init__(self, cluster: Cluster, interval: float = 0.5, key: str = "global") -> None:
        super().__init__(name="campaign-sampler", daemon=True)
        self.cluster = cluster
        self.interval = interval
        self.key = key
        self.stop = threading.Event()
        self.samples: list[Sample] = []
        self.takeovers = 0
        self.errors: Counter[str] = Counter()
        self._generation = 0

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.sample_once()

    def sample_once(self) -> None:
        try:
            view = self.cluster.lease(self.key)
            if view is not None and view.generation > self._generation and view.holder_id:
                self.cluster.stamp_takeover(self.key, view)
                self._generation = view.generation
                self.takeovers += 1
        except Exception as exc:
            self.errors[type(exc).__name__] += 1
        for r in list(self.cluster.replicas):
            if not r.alive() or r.port is None:
                continue
            try:
                _, body = http_get(int(r.port), "/readyz")
            except Exception as exc:
                self.errors[f"http {type(exc).__name__}"] += 1
                continue
            sup = next((s for s in body.get("supervisors", []) if s.get("key") == self.key), {})
            self.samples.append(
                Sample(
                    time.monotonic(),
                    r.name,
                    r.holder_id,
                    str(body.get("status")),
                    bool(sup.get("leader")),
                    sup.get("generation"),
                )
            )


@dataclass
class Nemesis:
    """Cycles through faults; remembers which host processes it killed."""

    cluster: Cluster
    proxy: FaultProxy | None
    lease: float
    seed: int
    db_path: Path | None = None  # SQLite: the file whose write lock a blip holds
    volume: Path | None = None  # SQLite: a size-limited volume under it, to fill now and then
    keep_hosts: int = 1
    host_args: tuple[str, ...] = ()
    role: str = "background"
    counts: Counter[str] = field(default_factory=Counter)
    killed: set[str] = field(default_factory=set)
    start_failures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def run(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        actions = [
            (self.blip, 4),
            (self.long_outage, 1),
            (self.kill_forkserver, 2),
            (self.kill_worker, 3),
            (self.kill_host, 1),
        ]
        if self.proxy is not None:
            actions.append((self.latency, 1))
        if self.volume is not None:
            actions.append((self.disk_full, 2))
        weights = [w for _, w in actions]
        while time.monotonic() < end:
            (action,) = self.rng.choices([a for a, _ in actions], weights)
            action()
            time.sleep(self.rng.uniform(0.5, 2.5))
        self.heal()

    # -- database faults --------------------------------------------------------------------
    def _outage(self, seconds: float) -> None:
        if self.proxy is not None:
            self.proxy.blackhole()
            time.sleep(seconds)
            self.proxy.heal()
            self.proxy.drop()  # the dead connections are reset when the network comes back
            return
        assert self.db_path is not None
        with write_lock_held(self.db_path, seconds) as holder:
            holder.wait(seconds + 30)

    def blip(self) -> None:
        self.counts["blip"] += 1
        if self.proxy is not None and self.rng.random() < 0.3:
            self.counts["blip_reset"] += 1
            self.proxy.drop()  # an instant reset of every connection
            return
        self.counts["blip_outage"] += 1  # MySQL: a short black hole; SQLite: the write lock held
        self._outage(self.rng.uniform(0.2, 5.0))

    def long_outage(self) -> None:
        self.counts["long_outage"] += 1
        self._outage(self.lease * self.rng.uniform(1.5, 2.5))

    def latency(self) -> None:
        assert self.proxy is not None
        self.counts["latency"] += 1
        self.proxy.latency(self.rng.uniform(0.02, 0.3))
        time.sleep(self.rng.uniform(1, 4))
        self.proxy.latency(0)

    def disk_full(self) -> None:
        assert self.volume is not None
        self.counts["disk_full"] += 1
        filler = fill(self.volume)
        try:
            time.sleep(self.rng.uniform(0.5, 4.0))
        finally:
            filler.unlink()

    def heal(self) -> None:
        if self.proxy is not None:
            self.proxy.heal()

    # -- process faults ---------------------------------------------------------------------
    def _alive_hosts(self) -> list[Replica]:
        return [r for r in self.cluster.replicas if r.alive() and r.name not in self.killed]

    def kill_forkserver(self) -> None:
        for r in self.rng.sample(self._alive_hosts(), k=len(self._alive_hosts())):
            pid = forkserver_of(r)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self.counts["forkserver_kill"] += 1
                return

    def kill_worker(self) -> None:
        for r in self.rng.sample(self._alive_hosts(), k=len(self._alive_hosts())):
            pids = workers_of(r)
            if pids:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.rng.choice(pids), signal.SIGKILL)
                self.counts["worker_kill"] += 1
                return

    def kill_host(self) -> None:
        hosts = self._alive_hosts()
        if not hosts:
            return
        victim = self.rng.choice(hosts)
        self.killed.add(victim.name)
        self.cluster.kill9(victim)
        self.counts["host_kill"] += 1
        self.replace_hosts()

    def replace_hosts(self) -> None:
        """Start hosts until ``keep_hosts`` run (a service manager's restart)."""
        while len(self._alive_hosts()) < self.keep_hosts:
            for _attempt in range(20):
                r = self.cluster.start(self.role, *self.host_args)
                try:
                    self.cluster.wait_ready(r, timeout=60)
                    break
                except AssertionError:
                    self.start_failures.append(r.name)  # reported: it exited on its own
                    time.sleep(0.5)
            else:
                raise AssertionError("could not start a replacement host")
