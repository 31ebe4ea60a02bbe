"""The Worker launcher: a pre-warmed process that forks one Worker per launch message.

Why not ``multiprocess``'s forkserver: per launch it pickled a process object and its
preparation data, the child unpickled both, ran the package's bootstrap and exit hooks, and the
host probed a resource tracker that Workers never use: 3-5 ms of CPU per invocation on top of
the fork itself. Here a launch is one message and the child calls the Worker's entry point
directly.

Protocol (per launch, host -> zygote): one message on the launch *channel*, a
``SOCK_SEQPACKET`` socket pair made when the zygote starts: ``header | target | payload`` with
two fds attached (``SCM_RIGHTS``): the write end of the launch's *status pipe* and the write end
of its *hold pipe* (a launch longer than one record continues in the records that follow). The
zygote forks; the child runs :func:`apsup.workers.child.main` with the hold fd (it writes its
own pid there first and keeps it open for life); the zygote writes the child's pid into the
status pipe, and later, when it has reaped the child (``SIGCHLD``), its exit code
(``waitstatus_to_exitcode``), then closes it. The host reads both from the status pipe's read
end (``apsup.workers.pool``): the pid, and the exit status that confirms the exit. EOF without
a status means the zygote died; the pool then adopts the Worker as its subreaper. One socket for
all launches, rather than a connection per launch, spares both processes a socket, a connect,
an accept and two closes per Worker: in the zygote, every object that work touches is a page
copied again while young Workers share its memory.

The zygote exits when the host closes the *alive* pipe or the channel (the host stopped, or
died): it forks nothing more; Workers it forked keep running under their own deadlines.

Started as ``python -c <boot> CHANNEL_FD ALIVE_FD MODULE...`` with SIGINT ignored from its
first instruction (``_sigint_ignored``): the interpreter's default ``sys.path`` with
``PYTHONPATH`` and the working directory, like any fresh process. It imports the preload
modules (an ``ImportError`` is left for the pool's probe to report; any other error at import
ends it, and the pool tells why), then serves.
"""

from __future__ import annotations

import _signal
import array
import contextlib
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import NoReturn

from apsup.workers import child, fork
from apsup.workers.fds import write_signed

_HEADER = struct.Struct("!ddII")  # timeout, grace, len(target), len(payload)
#: Largest record on the launch channel; a longer launch continues in further records.
_RECORD = 1 << 15
#: Most fds one launch carries: its status and hold pipes, then up to 8 for the Worker itself
#: (``apsup.workers.child.launch_fds``: the host's log streams).
_MAX_FDS = 2 + 8
_ANCILLARY = socket.CMSG_SPACE(_MAX_FDS * 4)
#: The zygote's command: ``-c`` (not ``-m``, which would run a second copy of this module).
_BOOT = "import sys; from apsup.workers.zygote import main; main(sys.argv[1:])"


# -- host side ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Start a forkserver that ignores SIGINT from its first instruction. A terminal's Ctrl-C
    reaches the whole process group; a forkserver that ignored SIGINT only after its preload
    imports died of a Ctrl-C during them (a ``KeyboardInterrupt`` traceback, and a stop that
    looked like a configuration error). An ignored signal stays ignored across
    fork and exec, and Python installs its own SIGINT handler only where it starts with the
    default one. Meanwhile this process keeps SIGINT blocked, not ignored: one that arrives then
    stays pending and reaches the restored handler. Main thread only (elsewhere Python cannot
    change handlers, and the terminal's SIGINT is the main thread's application's business)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class Zygote:
    """The host's handle on its zygote process (one per pool)."""

    def __init__(self, preload: list[str]) -> None:
        self.preload = list(preload)
        self.pid: int | None = None
        self.alive_w: int | None = None
        self._channel: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()

    def start(self) -> None:
        """Start a zygote (the caller knows none runs). Its end of the launch channel exists
        before it does, so launches sent while it imports its preload modules wait in the
        channel's buffer."""
        host_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        alive_r, alive_w = os.pipe()
        try:
            cmd = [sys.executable, "-c", _BOOT, str(zygote_end.fileno()), str(alive_r)]
            with _sigint_ignored():
                self._proc = subprocess.Popen(
                    [*cmd, *self.preload],
                    pass_fds=(zygote_end.fileno(), alive_r),
                    stdin=subprocess.DEVNULL,
                )
        except BaseException:
            os.close(alive_w)
            host_end.close()
            raise
        finally:
            os.close(alive_r)
            zygote_end.close()
        self.pid, self.alive_w, self._channel = self._proc.pid, alive_w, host_end

    def send(
        self,
        target: str,
        payload: bytes,
        timeout: float,
        grace: float,
        hold_w: int,
        send_timeout: float,
        extra_fds: tuple[int, ...] = (),
    ) -> int:
        """Send one launch; returns the read end of its status pipe. ``TimeoutError`` if the
        channel stays full for ``send_timeout`` (the zygote does not read: wedged).
        ``extra_fds`` go to the Worker (``child.launch_fds``); the caller keeps its copies."""
        channel = self._channel
        assert channel is not None
        status_r, status_w = os.pipe()
        try:
            name = target.encode()
            message = _HEADER.pack(timeout, grace, len(name), len(payload)) + name + payload
            channel.settimeout(send_timeout)
            fds = [
                (
                    socket.SOL_SOCKET,
                    socket.SCM_RIGHTS,
                    array.array("i", (status_w, hold_w, *extra_fds)),
                )
            ]
            channel.sendmsg([message[:_RECORD]], fds, socket.MSG_NOSIGNAL)
            for at in range(_RECORD, len(message), _RECORD):
                channel.sendmsg([message[at : at + _RECORD]], [], socket.MSG_NOSIGNAL)
            return status_r
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)

    def stop(self, timeout: float) -> None:
        """Close the alive pipe and the channel (the zygote exits), wait up to ``timeout``, then
        kill it. It is our direct child: its pid is safe to signal until we reap it here."""
        pid = self.pid
        if self.alive_w is not None:
            with contextlib.suppress(OSError):
                os.close(self.alive_w)
            self.alive_w = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if pid is not None:
            end = time.monotonic() + timeout
            try:
                while os.waitpid(pid, os.WNOHANG)[0] == 0:
                    if time.monotonic() >= end:
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                        break
                    time.sleep(0.01)
            except ChildProcessError:
                pass
            if self._proc is not None:
                self._proc.returncode = 0  # reaped above: Popen must not wait for it again
        self.pid = None
        self._proc = None


# -- zygote side --------------------------------------------------------------------------------


def _recv_launch(channel: socket.socket) -> tuple[bytes, list[int]] | None:
    """The next launch on the channel: its message and the fds it carries; None once the host
    has closed the channel."""
    data, ancillary, _flags, _addr = channel.recvmsg(_RECORD, _ANCILLARY)
    if not data:
        return None
    fds: list[int] = []
    for level, kind, raw in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += array.array("i", raw[: len(raw) - len(raw) % 4])
    if len(data) >= _HEADER.size:
        _timeout, _grace, name, size = _HEADER.unpack_from(data)
        total = _HEADER.size + name + size
        while len(data) < total:  # the rest follows at once, record by record
            more = channel.recv(_RECORD)
            if not more:
                break
            data += more
    return data, fds


def _run_child(
    message: bytes, hold_w: int, extra: list[int], unused: list[int], lean: bool
) -> NoReturn:
    fork.forked_lean = lean
    code = 1
    try:
        for fd in unused:
            try:  # noqa: SIM105 - suppress() is three cold calls per fd in a fresh Worker
                os.close(fd)
            except OSError:
                pass
        signal.set_wakeup_fd(-1)
        _signal.signal(signal.SIGCHLD, _signal.SIG_DFL)  # see apsup.workers.child.main
        timeout, grace, size, _payload_size = _HEADER.unpack_from(message)
        start = _HEADER.size
        target = message[start : start + size].decode()
        payload = message[start + size :]
        child.main(target, payload, timeout, grace, hold_fd=hold_w, extra_fds=tuple(extra))
    except BaseException:
        with contextlib.suppress(Exception):
            sys.excepthook(*sys.exc_info())
            sys.stderr.flush()
    finally:
        os._exit(code)


def serve(channel_fd: int, alive_r: int) -> None:
    """Fork one Worker per launch until the host closes the alive pipe or the channel.

    One ``poll`` object and one ``recvmsg`` per launch: everything the zygote writes between
    two forks is a page copied again (the young Workers still share it), so its loop stays
    small."""
    sig_r, sig_w = os.pipe()
    os.set_blocking(sig_r, False)
    os.set_blocking(sig_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # its wake-up fd is what matters
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.set_wakeup_fd(sig_w)
    status_of: dict[int, int] = {}  # child pid -> write end of its status pipe
    poller = select.poll()
    for watched in (channel_fd, alive_r, sig_r):
        poller.register(watched, select.POLLIN)
    with socket.socket(fileno=channel_fd) as channel:
        while True:
            ready = [fd for fd, _ in poller.poll()]
            if alive_r in ready:
                return  # the host is gone or stopped us: fork nothing more
            if sig_r in ready:
                with contextlib.suppress(OSError):
                    while os.read(sig_r, 4096):
                        pass
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    fd = status_of.pop(pid, None)
                    if fd is not None:
                        with contextlib.suppress(OSError):
                            write_signed(fd, os.waitstatus_to_exitcode(status))
                        os.close(fd)
            if channel_fd not in ready:
                continue
            try:
                launch = _recv_launch(channel)
            except OSError:
                continue
            if launch is None:
                return  # the host closed the channel: fork nothing more
            message, fds = launch
            if not 2 <= len(fds) <= _MAX_FDS or len(message) < _HEADER.size:
                for fd in fds:
                    os.close(fd)
                continue
            status_w, hold_w, *extra = fds
            pid, lean = fork.fork()
            if pid == 0:
                _run_child(
                    message,
                    hold_w,
                    extra,
                    [channel_fd, alive_r, sig_r, sig_w, status_w, *status_of.values()],
                    lean,
                )
            for fd in (hold_w, *extra):  # the Worker's now: no other Worker may inherit them
                os.close(fd)
            try:
                write_signed(status_w, pid)
            except OSError:
                os.close(status_w)  # the host gave up on this launch
                continue
            status_of[pid] = status_w


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel_fd, alive_r, *preload = argv
    fork.watch_hooks()  # before the preloads: a hook of theirs rules out the lean fork
    for name in preload:
        # An ImportError is reported by the pool's probe launch, with what to do about it.
        with contextlib.suppress(ImportError):
            __import__(name)
    with contextlib.suppress(OSError):
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
    serve(int(channel_fd), int(alive_r))


if __name__ == "__main__":
    main(sys.argv[1:])
