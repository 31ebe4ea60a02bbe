"""Start and stop a throwaway seekdb (OceanBase, MySQL mode) server for the test suite.

The binary ships inside the PyPI package ``pylibseekdb`` (test extras). The bash twin of this
module is ``./run``; keep the two in step (DESIGN.md §7 lists the server's pitfalls):

- it takes ~1.5 s to accept connections; we poll with PyMySQL on 127.0.0.1;
- SIGTERM makes it exit 137: stop with SIGTERM, poll, then SIGKILL after a grace period;
- it listens on 0.0.0.0 whatever we ask, so tests only ever connect to 127.0.0.1, and root
  gets a random password as soon as the server accepts connections (it starts with none);
- its time zone is fixed when the data folder is first created: always start from a fresh one.
  It is left at seekdb's default (+08:00) on purpose, so the suite proves that apsup keeps
  database time in UTC whatever the server's zone is.

Usable as a module (``SeekdbServer``) or from the shell for manual debugging::

    python -m tests.seekdb_server        # start, print the URL, stop on Ctrl-C
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
VAR_DIR = REPO_ROOT / "var"
READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0


class SeekdbUnavailable(RuntimeError):
    """The seekdb server cannot be started here (package missing or the server did not come up)."""


def seekdb_binary() -> Path:
    """Path of the ``seekdb`` executable shipped in ``pylibseekdb``."""
    try:
        import pylibseekdb
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SeekdbUnavailable(
            "pylibseekdb is not installed: run `pip install -e '.[test]'` (or `./run test`)"
        ) from exc
    binary = Path(pylibseekdb.__file__).resolve().parent / "seekdb"
    if not os.access(binary, os.X_OK):
        raise SeekdbUnavailable(f"{binary} is missing or not executable")
    return binary


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _load_prctl():  # type: ignore[no-untyped-def]
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux/glibc
        return None


_PRCTL = _load_prctl()  # resolved before any fork: the child must not load libraries
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGKILL the server when its starter dies (no orphaned 300 MB servers)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"({path} not readable)"
    return "\n".join(text[-lines:])


def prune_stale(var_dir: Path = VAR_DIR) -> None:
    """Remove ``var/seekdb-*`` folders whose server is gone (killed runs leave ~160 MB each).

    A folder counts as stale only when its ``run/seekdb.pid`` names a dead process; a folder
    without a pid file may belong to a server that is starting right now and is left alone.
    """
    for base in var_dir.glob("seekdb-*"):
        try:
            pid = int((base / "run" / "seekdb.pid").read_text().strip())
        except (OSError, ValueError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(base, ignore_errors=True)
        except PermissionError:
            continue


class SeekdbServer:
    """One seekdb process on a free loopback port with a fresh data folder under ``var/``."""

    def __init__(self, var_dir: Path = VAR_DIR) -> None:
        self.var_dir = var_dir
        self.port: int | None = None
        self.base_dir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.password = ""

    @property
    def admin_url(self) -> str:
        """Server URL without a database: ``mysql+pymysql://root:PASSWORD@127.0.0.1:PORT/``."""
        assert self.port is not None, "server not started"
        return f"mysql+pymysql://root:{self.password}@127.0.0.1:{self.port}/"

    def log_tail(self) -> str:
        if self.base_dir is None:
            return "(server not started)"
        return (
            f"--- {self.base_dir / 'console.out'} ---\n{_tail(self.base_dir / 'console.out')}\n"
            f"--- {self.base_dir / 'log' / 'seekdb.log'} ---\n"
            f"{_tail(self.base_dir / 'log' / 'seekdb.log')}"
        )

    def start(self, attempts: int = 3) -> SeekdbServer:
        binary = seekdb_binary()
        prune_stale(self.var_dir)
        error: SeekdbUnavailable | None = None
        for _ in range(attempts):  # a fresh port each time: the free port may be taken meanwhile
            try:
                self._start_once(binary)
                return self
            except SeekdbUnavailable as exc:
                error = exc
                self.stop(keep_logs=False)
        assert error is not None
        raise error

    def _start_once(self, binary: Path) -> None:
        self.port = free_loopback_port()
        self.base_dir = self.var_dir / f"seekdb-{self.port}"
        shutil.rmtree(self.base_dir, ignore_errors=True)
        self.base_dir.mkdir(parents=True)
        env = dict(os.environ, TELEMETRY_ENABLED="false")
        with open(self.base_dir / "console.out", "wb") as console:
            self.proc = subprocess.Popen(
                [
                    str(binary),
                    "--nodaemon",
                    "--port",
                    str(self.port),
                    "--base-dir",
                    str(self.base_dir),
                    "--log-level",
                    "WARN",
                ],
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # Ctrl-C on the test run does not hit the server directly
                preexec_fn=_die_with_parent if _PRCTL is not None else None,
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        import pymysql

        assert self.proc is not None and self.port is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SeekdbUnavailable(
                    f"seekdb exited with status {self.proc.returncode} before accepting "
                    f"connections on 127.0.0.1:{self.port}\n{self.log_tail()}"
                )
            try:
                conn = pymysql.connect(
                    host="127.0.0.1", port=self.port, user="root", connect_timeout=2
                )
            except pymysql.err.MySQLError as exc:
                last_error = exc
                time.sleep(0.1)
                continue
            password = secrets.token_hex(16)
            try:
                with conn.cursor() as cur:
                    cur.execute("ALTER USER root IDENTIFIED BY %s", (password,))
            finally:
                conn.close()
            self.password = password
            return
        raise SeekdbUnavailable(
            f"seekdb did not accept connections on 127.0.0.1:{self.port} within "
            f"{READY_TIMEOUT_S:.0f} s (last error: {last_error})\n{self.log_tail()}"
        )

    def wait_quiet(self, share: float = 0.05, window: float = 1.0, limit: float = 60.0) -> float:
        """Wait until the server's own CPU use over ``window`` seconds falls below ``share`` of
        one CPU (at most ``limit`` seconds); returns the seconds waited.

        A server that has just accepted its first connection keeps bootstrapping in the
        background for several seconds (about 10 here, at up to 65% of a CPU): a benchmark
        that starts measuring at once charges that work to its first round."""
        assert self.proc is not None, "server not started"
        stat = Path(f"/proc/{self.proc.pid}/stat")
        tick = os.sysconf("SC_CLK_TCK")

        def cpu() -> float:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / tick

        start = time.monotonic()
        while time.monotonic() - start < limit:
            before = cpu()
            time.sleep(window)
            if cpu() - before < share * window:
                break
        return time.monotonic() - start

    def stop(self, keep_logs: bool = False) -> None:
        """SIGTERM, wait up to ``STOP_GRACE_S``, then SIGKILL; remove the data folder.

        With ``keep_logs`` the ``log/`` folder and console output stay for a post-mortem and only
        the (large) data files are removed.
        """
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)  # exits 137 on SIGTERM; the status is irrelevant
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(timeout=STOP_GRACE_S)
        if self.base_dir is not None:
            if keep_logs:
                shutil.rmtree(self.base_dir / "store", ignore_errors=True)
            else:
                shutil.rmtree(self.base_dir, ignore_errors=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    signal.signal(signal.SIGINT, _interrupt)  # also when started in the background (SIGINT ignored)
    signal.signal(signal.SIGTERM, _interrupt)
    t0 = time.monotonic()
    server = SeekdbServer().start()
    print(f"seekdb ready in {time.monotonic() - t0:.2f} s: {server.admin_url}", flush=True)
    print("Ctrl-C (or SIGTERM) to stop", flush=True)
    try:
        while server.proc is not None and server.proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
