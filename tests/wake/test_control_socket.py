"""The SQLite host's control socket: private to its user, coalescing, and one host per database.

- Another local user can neither squat the socket before the host starts nor wake the host;
  even given access to the socket, their datagrams are ignored (kernel-supplied credentials).
- A flood of wake-ups costs the host a bounded share of a core, and real requests still go
  through during it.
- A second host exits 3 with one line and no traceback, whether refused by the host lock or by
  a socket that still answers; a dead host's socket is replaced.

The other user is ``nobody``, in a child forked from this (root) test process.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from apsup.supervisor.control import control_dir, send_wakeup, socket_path
from tests.wake.support import App, Host, make_app, run_cli

pytestmark = pytest.mark.timeout(180)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")


@pytest.fixture
def shared_base() -> Iterator[Path]:
    """A folder other users may traverse (pytest's own tmp folders are 0700)."""
    base = Path(tempfile.mkdtemp(prefix="apsup-ctl-"))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def app(shared_base: Path) -> App:
    a = make_app(shared_base)
    for folder in (a.root, a.db.parent):
        os.chmod(folder, 0o755)  # readable by others, writable only by the owner
    return a


def as_nobody(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a forked child as user ``nobody``; returns its JSON-able result."""
    user = pwd.getpwnam("nobody")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 0
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            os.write(write_end, json.dumps(fn()).encode())
        except BaseException as exc:
            os.write(write_end, json.dumps({"child error": repr(exc)}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def _attempt(fn: Callable[[], object]) -> str:
    try:
        fn()
    except OSError as exc:
        return type(exc).__name__
    return "ok"


def _bind(path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))


def _send(path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(b"wake-manual", str(path))


@needs_root
def test_another_user_cannot_squat_or_wake_the_host(app: App) -> None:
    sock = socket_path(app.db)
    squat = as_nobody(
        lambda: {
            "mkdir": _attempt(lambda: os.mkdir(control_dir(app.db))),
            "bind": _attempt(lambda: _bind(sock)),
        }
    )
    assert squat == {"mkdir": "PermissionError", "bind": "FileNotFoundError"}, squat

    host = Host(app).start().wait_ready()
    try:
        mode = os.stat(control_dir(app.db)).st_mode
        assert stat.S_IMODE(mode) == 0o700 and stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        wake = as_nobody(
            lambda: {"send": _attempt(lambda: _send(sock)), "notify": send_wakeup(app.db, "x")}
        )
        assert wake == {"send": "PermissionError", "notify": False}, wake

        # Even with the socket opened up by mistake, a foreign datagram is ignored.
        os.chmod(control_dir(app.db), 0o711)
        os.chmod(sock, 0o666)
        host.wait_quiet()
        since = time.time()
        assert as_nobody(lambda: {"send": _attempt(lambda: _send(sock))}) == {"send": "ok"}
        time.sleep(2.0)
        assert host.activity(after=since) == [], "a foreign datagram woke the host"
        assert "wake-up from another user ignored" in host.output()
        assert f'"uid":{pwd.getpwnam("nobody").pw_uid}' in host.output().replace(" ", "")

        # The owner's own wake-ups still work.
        app.publish("request", "manual", "own-1")
        app.wait_run("wake-manual", "own-1")
    finally:
        assert host.stop() == 0


@needs_root
def test_a_foreign_control_directory_is_refused_not_used(app: App) -> None:
    """Where the database's folder is writable by others, a directory planted there by another
    user is never used: exit 2, one line naming it, no traceback."""
    os.chmod(app.db.parent, 0o1777)
    planted = as_nobody(lambda: {"mkdir": _attempt(lambda: os.mkdir(control_dir(app.db), 0o777))})
    assert planted == {"mkdir": "ok"}
    out = run_cli(app, "run", "--app", "wakeapp.families")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("apsup: ") and str(control_dir(app.db)) in last, last


def test_a_wakeup_flood_costs_bounded_cpu_and_requests_still_pass(app: App) -> None:
    host = Host(app).start().wait_ready()
    flooder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, sys, time\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
            "end, tried, sent = time.monotonic() + float(sys.argv[2]), 0, 0\n"
            "while time.monotonic() < end:\n"
            "    tried += 1\n"
            "    try:\n"
            "        s.sendto(b'wake-manual', socket.MSG_DONTWAIT, sys.argv[1]); sent += 1\n"
            "    except OSError:\n"
            "        pass\n"
            "print(tried, sent)\n",
            str(socket_path(app.db)),
            "6",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        host.wait_quiet(1.0)
        cpu0, wall0 = host.cpu_seconds(), time.monotonic()
        time.sleep(1.0)
        app.publish("request", "manual", "during-flood")
        app.wait_run("wake-manual", "during-flood", limit=10.0)
        time.sleep(1.0)
        share = (host.cpu_seconds() - cpu0) / (time.monotonic() - wall0)
        out, _ = flooder.communicate(timeout=30)
        tried, sent = map(int, out.split())
        print(f"\n[flood] {tried} sends in 6 s, {sent} queued; host used {share:.1%} of a core")
        assert tried > 10_000  # it was a flood
        assert share < 0.35  # the unbounded loop spent ~40 % before coalescing, plus the request
    finally:
        flooder.kill()
        assert host.stop() == 0


def test_a_second_host_exits_3_with_one_line(app: App) -> None:
    first = Host(app).start().wait_ready()
    try:
        out = run_cli(app, "run", "--app", "wakeapp.families")
    finally:
        assert first.stop() == 0
    assert out.returncode == 3, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("apsup: another apsup host")


def test_a_socket_that_still_answers_is_a_second_host_exit_3(app: App) -> None:
    """A receiver on the socket without the host lock (e.g. the same database reached through
    another path) is refused at bind: exit 3, one line, no traceback."""
    os.mkdir(control_dir(app.db), 0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as squatter:
        squatter.bind(str(socket_path(app.db)))
        out = run_cli(app, "run", "--app", "wakeapp.families")
    assert out.returncode == 3, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("apsup: another apsup host is listening on"), last


def test_a_dead_hosts_socket_is_replaced(app: App) -> None:
    os.mkdir(control_dir(app.db), 0o700)
    _bind(socket_path(app.db))  # closed at once: a leftover file nobody receives on
    host = Host(app).start().wait_ready()
    try:
        app.publish("request", "manual", "after-stale")
        app.wait_run("wake-manual", "after-stale", limit=10.0)
    finally:
        assert host.stop() == 0
    assert not socket_path(app.db).exists()  # removed on a clean stop
