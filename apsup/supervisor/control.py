"""Wake-ups for a SQLite host, its private control socket, and the single-host guard.

A SQLite host polls nothing while idle; it learns of new intent in two independent ways:

1. **Commit hook + datagram.** ``Family.request``/``mark_dirty`` register a hook on the caller's
   SQLAlchemy ``Connection``; when that transaction commits, the hook sends one non-blocking
   datagram naming the family to the host's control socket. SQLAlchemy's ``commit`` event runs
   just *before* the driver's COMMIT, while the publisher still holds SQLite's write lock, so the
   host takes the write lock once (an empty ``BEGIN IMMEDIATE``) before it reads: that waits for
   the publisher's commit to finish. The send never blocks, never raises into the caller's
   commit and costs a few microseconds when no host listens.
2. **File watch.** At most once per ``WATCH_SECONDS`` the host compares a signature of the
   database files (``stat`` of the database and its ``-wal``: inode, size, timestamps): no
   database statement. A change runs one request pass per family. This catches, within about
   a second and without a restart, the commits the hook cannot report: a datagram dropped by a
   full socket queue, a publisher of another user, a commit that bypassed SQLAlchemy's
   transaction events.

The socket is a filesystem socket ``<db>.apsup/wake.sock`` (0600) inside a directory created
0700 beside the database. Other users cannot reach it (no search permission on the directory);
the host also reads each datagram's kernel-supplied credentials (``SO_PASSCRED``) and ignores any
whose uid is neither its own nor root's. Wake-ups are coalesced: the host drains at most
``DRAIN_LIMIT`` datagrams at a time and at most once per ``MIN_WAKE_INTERVAL``; senders to a full
queue fail at once (their own cost), and a full queue is treated as "every family".

The host lock is an ``flock`` on ``<db>.host.lock``: the kernel releases it when the host dies,
so a crashed host never blocks its successor, while a second live host is refused. Under that
lock a leftover socket file of a dead host is replaced; a socket that still answers means a host
runs on the same database through another path, and is refused the same way (exit 3).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import stat
import struct
import weakref
from pathlib import Path
from typing import Any

from sqlalchemy import URL, Connection, event

from apsup.errors import ConfigError, HostConflictError
from apsup.store import backend_kind
from apsup.store.sqlite import database_path

log = logging.getLogger("apsup.control")

MAX_DATAGRAM = 512
#: The host handles wake-ups at most this often (a flood costs it a bounded amount of CPU).
MIN_WAKE_INTERVAL = 0.05
#: At most this many datagrams are read per drain; a full drain means some may have been lost.
DRAIN_LIMIT = 64
#: How often the host compares the database files' signature (the fallback for lost datagrams).
WATCH_SECONDS = 1.0
#: A wake-up meaning "every family" (a full queue, or a change seen by the file watch).
ALL = "*"
CONTROL_SUFFIX = ".apsup"
SOCKET_NAME = "wake.sock"
#: The running host's HTTP listener (``http://127.0.0.1:PORT``), for ``apsup status``.
LISTENER_NAME = "http"
#: sun_path holds 108 bytes; longer paths are reached through /proc/self/fd/<dir fd>/.
_MAX_SOCKET_PATH = 100
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def control_dir(db_path: Path) -> Path:
    """The private directory beside ``db_path`` holding the control socket."""
    return db_path.with_name(db_path.name + CONTROL_SUFFIX)


def socket_path(db_path: Path) -> Path:
    return control_dir(db_path) / SOCKET_NAME


class _Address:
    """A socket address usable with ``bind``/``sendto`` even for long paths (closes its fd)."""

    def __init__(self, path: Path) -> None:
        self.fd: int | None = None
        raw = os.fsencode(path)
        if len(raw) <= _MAX_SOCKET_PATH:
            self.address: str = str(path)
        else:
            self.fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            self.address = f"/proc/self/fd/{self.fd}/{path.name}"

    def __enter__(self) -> str:
        return self.address

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# -- publisher side -------------------------------------------------------------------------------


_socket_paths: dict[Path, Path] = {}
_sender: socket.socket | None = None


def _sender_socket() -> socket.socket:
    # One unbound datagram socket per process, shared by threads (and harmlessly by a fork).
    global _sender
    if _sender is None:
        _sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    return _sender


def send_wakeup(db_path: Path, family: str) -> bool:
    """One non-blocking datagram to the host of ``db_path``; False when none received it."""
    global _sender
    path = _socket_paths.get(db_path)
    if path is None:
        path = _socket_paths[db_path] = socket_path(db_path)
    try:
        with _Address(path) as address:
            _sender_socket().sendto(family.encode()[:MAX_DATAGRAM], socket.MSG_DONTWAIT, address)
    except OSError as exc:
        if exc.errno in (errno.EBADF, errno.ENOTSOCK):
            _sender = None  # closed under us (e.g. by a daemonising library): renew next time
        # No host (ENOENT/ECONNREFUSED), another user's host (EACCES) or a full queue (EAGAIN):
        # the intent is durable; a host finds it through its file watch or at startup.
        return False
    return True


def notify(database_url: str, family: str) -> bool:
    """Tell a running host on this machine that ``family`` has new intent. Best effort.

    ``request``/``mark_dirty`` already do this when their transaction commits; this is for
    callers that wrote intent some other way.
    """
    if backend_kind(database_url) != "sqlite":
        return False  # MySQL hosts discover cross-process requests by bounded polling
    path = database_path(database_url)
    if path is None:
        return False
    return send_wakeup(path, family)


_db_paths: dict[URL, Path | None] = {}
_pending: weakref.WeakKeyDictionary[Connection, set[str]] = weakref.WeakKeyDictionary()


def _publisher_path(conn: Connection) -> Path | None:
    url = conn.engine.url
    try:
        return _db_paths[url]
    except KeyError:
        path = _db_paths[url] = database_path(url.render_as_string(hide_password=False))
        return path


def check_publisher(conn: Connection) -> None:
    """Refuse a connection on which published intent could never reach a host.

    Called by ``request``/``mark_dirty`` before they write anything.
    """
    name = conn.dialect.name
    if name not in {"sqlite", "mysql", "mariadb", "postgresql"}:
        raise ConfigError(
            f"apsup stores intent in SQLite, MySQL/OceanBase or PostgreSQL, not {name!r}: pass a "
            "connection of the database apsup runs on (apsup.connect(url) builds a suitable "
            "engine)"
        )
    autocommit = getattr(conn, "_is_autocommit_isolation", None)
    if autocommit is not None and autocommit():
        raise ConfigError(
            "request()/mark_dirty() must run inside the caller's transaction, but this "
            "connection is in AUTOCOMMIT mode: use `with engine.begin() as conn:`"
        )
    if name == "sqlite" and _publisher_path(conn) is None:
        raise ConfigError(
            "an in-memory SQLite database is private to this process, so no apsup host can see "
            "its intent: use a database file (sqlite:////absolute/path/app.db)"
        )


def wake_on_commit(conn: Connection, family: str, scope_id: str = "") -> None:
    """Send a wake-up for ``family`` when ``conn``'s current transaction commits: a datagram to
    the SQLite host's control socket, or on MySQL a nudge to the family's leaders naming one
    Scope the transaction wrote (``apsup.supervisor.nudge``).

    One listener pair per Connection; the families pending for its transaction are kept here
    and forgotten on rollback.
    """
    if conn.dialect.name != "sqlite":
        from apsup.supervisor.nudge import nudge_on_commit

        nudge_on_commit(conn, family, scope_id)
        return
    pending = _pending.get(conn)
    if pending is None:
        pending = _pending[conn] = set()
        event.listen(conn, "commit", _on_commit)
        event.listen(conn, "rollback", _on_rollback)
    pending.add(family)


def _on_commit(conn: Connection) -> None:
    # Runs just before the driver's COMMIT: it must never fail or block the caller's commit.
    try:
        families = _pending.get(conn)
        if not families:
            return
        names = sorted(families)
        families.clear()
        path = _publisher_path(conn)
        if path is not None:
            for name in names:
                send_wakeup(path, name)
    except Exception:  # pragma: no cover - defensive: a wake-up is never worth a failed commit
        log.debug("wake-up send failed", exc_info=True)


def _on_rollback(conn: Connection) -> None:
    families = _pending.get(conn)
    if families:
        families.clear()


# -- host side ------------------------------------------------------------------------------------


def _private_dir(path: Path) -> None:
    """Create ``path`` 0700, or accept it only if it is this user's own directory."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(
            f"cannot create the control directory {path}: {exc.strerror}; the database's "
            "directory must be writable by the user running apsup"
        ) from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ConfigError(
            f"{path} exists but is not a directory owned by this user (uid {st.st_uid}); "
            "remove it, and keep the database in a directory other users cannot write"
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def _max_queue_length() -> int:
    """The kernel's datagram queue length for Unix sockets (sends beyond it fail)."""
    try:
        return int(Path("/proc/sys/net/unix/max_dgram_qlen").read_text())
    except (OSError, ValueError):
        return 10


def _listening(address: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as probe:
        try:
            probe.connect(address)
        except OSError:
            return False
    return True


def _db_signature(db_path: Path) -> tuple[Any, ...]:
    # ``stat`` only: opening and closing any of the database's files in a process that holds
    # SQLite connections would drop that process's POSIX locks on it (SQLite then reinitialises
    # the -shm that this process still maps: SIGBUS).
    parts: list[Any] = []
    for suffix in ("", "-wal"):
        try:
            st = os.stat(f"{db_path}{suffix}")
            parts.append((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        except OSError:
            parts.append(None)
    return tuple(parts)


class ControlChannel:
    """The host's receiving end: a private datagram socket to include in its wait set."""

    min_interval = MIN_WAKE_INTERVAL
    watch_seconds = WATCH_SECONDS

    def __init__(self, database_url: str) -> None:
        path = database_path(database_url)
        if path is None:
            raise ConfigError("the control channel needs a SQLite database file")
        self.db_path = path
        self.path = socket_path(path)
        self.refused = 0  # datagrams from other users, ignored
        self._refused_uids: set[int] = set()
        self._uid = os.geteuid()
        self._signature = _db_signature(path)
        self._queue_length = _max_queue_length()
        self._limit = max(DRAIN_LIMIT, self._queue_length + 1)
        _private_dir(self.path.parent)
        self.sock = socket.socket(
            socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
        )
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            self._bind()
        except BaseException:
            self.sock.close()
            raise

    def _bind(self) -> None:
        with _Address(self.path) as address:
            try:
                self.sock.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise ConfigError(
                        f"cannot create the control socket {self.path}: {exc.strerror}"
                    ) from None
                if _listening(address):
                    raise HostConflictError(
                        f"another apsup host is listening on {self.path}; SQLite supports a "
                        "single host process: stop it, or use the mysql backend for several "
                        "replicas"
                    ) from None
                os.unlink(self.path)  # a dead host's socket: we hold the host lock
                self.sock.bind(address)
        os.chmod(self.path, 0o600)

    def fileno(self) -> int:
        return self.sock.fileno()

    def publish_listener(self, host: str, port: int) -> None:
        """Record the HTTP listener's address beside the database (removed by ``close``)."""
        if host in ("", "0.0.0.0"):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        target = self.path.with_name(LISTENER_NAME)
        tmp = target.with_name(LISTENER_NAME + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, f"http://{host}:{port}\n".encode())
        finally:
            os.close(fd)
        os.replace(tmp, target)

    def drain(self) -> set[str]:
        """The families woken since the last drain (coalesced); ``ALL`` if some may be lost."""
        names: set[str] = set()
        space = socket.CMSG_SPACE(_CRED.size)
        for count in range(self._limit):
            try:
                data, ancillary, _flags, _addr = self.sock.recvmsg(MAX_DATAGRAM, space)
            except OSError:  # BlockingIOError: drained
                if count >= self._queue_length:
                    names.add(ALL)  # the queue was full: later senders got EAGAIN
                return names
            uid = self._sender_uid(ancillary)
            if uid is not None and uid not in (self._uid, 0):
                self.refused += 1
                if uid not in self._refused_uids:
                    self._refused_uids.add(uid)
                    log.warning("wake-up from another user ignored", extra={"uid": uid})
                continue
            names.add(data.decode(errors="replace"))
        names.add(ALL)  # more were waiting than one drain reads
        return names

    @staticmethod
    def _sender_uid(ancillary: list[tuple[int, int, bytes]]) -> int | None:
        for level, kind, data in ancillary:
            ucred = level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
            if ucred and len(data) >= _CRED.size:
                return int(_CRED.unpack_from(data)[1])
        return None

    def files_changed(self) -> bool:
        """Whether the database files changed since the last call (no database statement)."""
        current = _db_signature(self.db_path)
        changed = current != self._signature
        self._signature = current
        return changed

    def close(self) -> None:
        self.sock.close()
        for leftover in (self.path, self.path.with_name(LISTENER_NAME)):
            with contextlib.suppress(OSError):
                os.unlink(leftover)


def local_listener(database_url: str) -> str | None:
    """The HTTP listener a running SQLite host on this machine published, if any."""
    try:
        if backend_kind(database_url) != "sqlite":
            return None
        path = database_path(database_url)
        if path is None:
            return None
        url = (control_dir(path) / LISTENER_NAME).read_text().strip()
    except (OSError, ConfigError, ValueError):
        return None
    return url or None


class HostLock:
    """Exclusive per-database host lock; SQLite supports one Runtime host process only."""

    def __init__(self, database_url: str) -> None:
        path = database_path(database_url)
        assert path is not None
        self.path = path.with_name(path.name + ".host.lock")
        self.fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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
