"""Local control channel and the single-host guard for SQLite.

SQLite has no idle polling (RFC §8): a host wakes on notifications. Other processes on the same
machine (``apsup trigger``, domain code after committing ``request``/``mark_dirty``) send a
datagram to an abstract Unix socket derived from the database file, so no socket file is left
behind and no path-length limit applies. A lost datagram loses no work: the intent is durable
and is recovered at the family's next check or the next startup.

The host lock is an ``flock`` on ``<db>.host.lock``: the kernel releases it when the host dies,
so a crashed host never blocks its successor, while a second live host is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import socket
from pathlib import Path

from apsup.errors import HostConflictError
from apsup.store import backend_kind
from apsup.store.sqlite import database_path

MAX_DATAGRAM = 512


def _address(db_path: Path) -> str:
    digest = hashlib.sha256(str(db_path).encode()).hexdigest()[:24]
    return f"\0apsup-{digest}"


def notify(database_url: str, family: str) -> bool:
    """Tell a running host on this machine that ``family`` has new intent. Best effort."""
    if backend_kind(database_url) != "sqlite":
        return False  # MySQL hosts discover cross-process requests by bounded polling
    path = database_path(database_url)
    if path is None:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(family.encode()[:MAX_DATAGRAM], _address(path))
        except OSError:
            return False  # no host running: the durable intent waits for the next startup
    return True


class ControlChannel:
    """The host's receiving end: a non-blocking datagram socket to include in its wait set."""

    def __init__(self, database_url: str) -> None:
        path = database_path(database_url)
        assert path is not None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(_address(path))
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def drain(self) -> set[str]:
        """All families notified since the last drain (coalesced)."""
        names: set[str] = set()
        while True:
            try:
                data = self.sock.recv(MAX_DATAGRAM)
            except BlockingIOError:
                return names
            except OSError:
                return names
            names.add(data.decode(errors="replace"))

    def close(self) -> None:
        self.sock.close()


class HostLock:
    """Exclusive per-database host lock; SQLite supports one Runtime host process only."""

    def __init__(self, database_url: str) -> None:
        path = database_path(database_url)
        assert path is not None
        self.path = path.with_name(path.name + ".host.lock")
        self.fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise HostConflictError(
                f"another apsup host (pid {holder}) already runs on {self.path.name[:-10]}; "
                "SQLite supports a single host process: stop it, or use the mysql backend "
                "for several replicas"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
