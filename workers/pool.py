"""Launch, time out, terminate and confirm Worker processes through a preloaded forkserver.

Why a forkserver with preload: the forkserver (``apsup.workers.zygote``) is a fresh interpreter
that imports the registered family modules once, before the host has opened any connection or
started any thread; each Worker is then an ``os.fork()`` of that clean image (launch to
confirmed exit a few ms vs ~250-300 ms for ``spawn``: ``benchmarks/launch.py``) and inherits no
parent state (DESIGN.md §4, §6).

Exit confirmation. A Worker is the *forkserver's* child, not ours: we cannot ``waitpid`` it. The
forkserver reaps it with ``waitpid`` and writes the wait status into a per-child pipe whose read
end is the handle's *sentinel*. Reading that status is the confirmation; pid existence never is
(a dead Worker may be an unreaped zombie, and pids are reused: ``pid_max`` is 32768 here). Only a
confirmed exit releases the handle, so capacity is never released early (RFC §6). If the
forkserver dies, the sentinel reports EOF (read as exit code 255); that is never taken as an
exit. Instead the pool makes its owner a child subreaper
(``PR_SET_CHILD_SUBREAPER``) when it starts: the Workers of a dead forkserver are reparented to
the owner, which adopts them, keeps enforcing their deadlines and confirms their exits with its
own ``waitpid`` (woken by a pidfd). A Worker that is no longer our child by then was already
reaped by the forkserver: it is gone, with its status lost (``ExitCode.STATUS_LOST``). Only
where the subreaper cannot be set does a Worker stay ``"unconfirmed"`` for good.

Timeouts. Each Worker leads its own process group (``apsup.workers.child`` calls ``setsid``), so
the pool signals the group: SIGTERM at the deadline (graceful: the child raises
``WorkerTerminated``), SIGKILL after ``grace_seconds``. When a Worker's exit is confirmed, any
stragglers left in its group are SIGKILLed too, so no grandchild outlives its Worker. Groups are
signalled through a pidfd opened at launch, never by a bare number that may have been reused
(see ``WorkerPool._signal_group``). The Worker also carries its deadline and stops itself if no
host is left to (``apsup.workers.deadline``).

Process-global state: the pool makes its owner a child subreaper, so only one open
``WorkerPool`` may exist per process, and a pool must be created after any fork of its owner
(the dedicated-mode launcher must fork Supervisors first; each creates its own pool).

Launches do not wait for the fork (``WorkerPool.submit``): the pid arrives on the same pipe as
the exit status, so the owner waits on it with the exits and the pool reads it in ``poll``; the
Worker's deadline counts from then. Measured at 8 Workers (300 no-op invocations, loaded 2-core
machine): the host loop spent 3.9 s of 5.1 s blocked in launches and all 8 Workers were in
flight 21% of the time; pipelined, 0.35 s and 90%.

The launcher is apsup's own (``apsup.workers.zygote``): one message per launch, the child calls
the Worker's entry point directly; this module keeps the accounting (capacity, deadlines,
signals, confirmation, adoption).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

from apsup.errors import ConfigError, WorkerStartError
from apsup.observability.logging import redact
from apsup.workers.exit_codes import ExitCode, describe
from apsup.workers.fds import readable
from apsup.workers.zygote import Zygote, read_signed

__all__ = ["ForkServerStuck", "WorkerExit", "WorkerHandle", "WorkerPool", "WorkerState"]

#: ``launching``: sent to the forkserver, pid not reported yet (occupies capacity; see
#: ``WorkerPool.submit``). ``running``: before its deadline. ``terminating``: SIGTERM sent to
#: its group. ``killing``: SIGKILL sent. ``unconfirmed``: no exit status after SIGKILL +
#: ``confirm_seconds``, or the forkserver that would report it is gone; still occupies capacity
#: (RFC §6).
WorkerState = Literal["launching", "running", "terminating", "killing", "unconfirmed"]

_CHILD_MODULE = "apsup.workers.child"
_FORKSERVER_EOF_EXITCODE = 255  # what a status pipe at EOF reads as (the zygote died)
#: Exits of a stopped Worker (graceful, second SIGTERM, SIGTERM before its handler, SIGKILL).
_STOP_CODES = frozenset(
    {ExitCode.TERMINATED, ExitCode.FORCED_EXIT, ExitCode.KILLED_SIGTERM, ExitCode.KILLED_SIGKILL}
)


class ForkServerStuck(TimeoutError):
    """The forkserver did not report a forked pid in time (wedged, or a preload import hangs).
    The pool has killed it, so no untracked Worker can appear later; the next launch starts a
    fresh forkserver, and Workers of the killed one become ``"unconfirmed"``."""


@dataclass(frozen=True, slots=True)
class WorkerExit:
    """A confirmed Worker exit (the forkserver's ``waitpid`` status reached us)."""

    worker_id: str
    #: ``ExitCode`` value, or any other exit status; ``-N`` = killed by signal N.
    exitcode: int
    #: Signal number that killed the Worker, ``None`` if it exited by itself.
    signal: int | None
    #: The pool terminated it because its deadline passed.
    timed_out: bool
    #: Seconds from launch to confirmation (monotonic).
    duration: float
    pid: int
    #: Stopped by ``terminate_all`` (shutdown or lease loss) rather than by its deadline.
    terminated: bool = False
    #: The launch failed and no Worker ran (``pid`` 0): the type of the error, e.g.
    #: ``ForkServerStuck``. Only :meth:`WorkerPool.submit` reports launch failures as exits.
    launch_error: str | None = None

    @property
    def reason(self) -> str:
        """Log-safe outcome, e.g. ``SUCCESS``, ``TERMINATED``, ``KILLED_SIGKILL``, ``SIGSEGV``."""
        if self.launch_error is not None:
            return "LAUNCH_FAILED"
        return describe(self.exitcode)


@dataclass(slots=True, eq=False)
class WorkerHandle:
    """A launched Worker that still occupies capacity (exit not yet confirmed)."""

    worker_id: str
    #: 0 while ``"launching"`` (the forkserver has not reported it yet).
    pid: int
    target: str
    #: ``time.monotonic()`` right after the child's pid arrived (while ``"launching"``: when
    #: the launch was sent); the timeout counts from here.
    started: float
    #: While ``"launching"``: when the forkserver counts as stuck (``ForkServerStuck``).
    deadline: float
    state: WorkerState = "running"
    #: Seconds from the Worker's start to its deadline.
    timeout: float = 0.0
    timed_out: bool = False
    terminated: bool = False
    term_sent_at: float | None = None
    kill_sent_at: float | None = None
    #: The forkserver died: this Worker's exit can never be confirmed (kept until ``close``).
    status_lost: bool = False
    #: The forkserver died and this Worker was reparented to us: we ``waitpid`` it ourselves;
    #: the pidfd (if the kernel has them) becomes readable when it exits.
    adopted: bool = False
    #: A pidfd naming this Worker's process (opened at launch): signals go through it, so they
    #: never reach a process that merely reuses the number (see ``WorkerPool._signal_group``).
    pidfd: int | None = None
    #: The Worker's process is known to be reaped: its pid (and pgid) may now name another.
    reaped: bool = False
    #: Read end of the launch's hold pipe. The forked Worker keeps the write end for its whole
    #: life and writes its own pid into it first, so a Worker whose forkserver died before
    #: reporting it is still found (its pid arrives here), and EOF without a pid proves that
    #: no Worker of this launch runs (``apsup.workers.child._report_pid``).
    hold: int | None = None
    #: The forkserver closed this launch's pipe without a pid: the pid is awaited on ``hold``.
    orphan: bool = False
    _popen: Any = field(default=None, repr=False)
    _forkserver_pid: int | None = field(default=None, repr=False)
    #: The status read from the forkserver's pipe (255 at EOF), once read.
    _status: int | None = field(default=None, repr=False)

    @property
    def sentinel(self) -> int:
        """Readable once the forkserver has written this Worker's pid (``"launching"``) or exit
        status (or, adopted, once the Worker has exited)."""
        if self.adopted and self.pidfd is not None:
            return self.pidfd
        if self.orphan and self.hold is not None:
            return self.hold
        return int(self._popen.sentinel)


class _Launch:
    """One launch's end of its status pipe: the zygote writes the pid, then the exit status."""

    __slots__ = ("pid", "sentinel")

    def __init__(self, sentinel: int) -> None:
        self.sentinel = sentinel
        self.pid: int | None = None

    def close(self) -> None:
        if self.sentinel >= 0:
            with contextlib.suppress(OSError):
                os.close(self.sentinel)
            self.sentinel = -1


def _readable(fd: int) -> bool:
    """Whether ``fd`` has data or is at EOF, without blocking (``poll``: any fd number)."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


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


_active_lock = threading.Lock()
#: Held while a pidfd is closed, and while another thread signals through pidfds, so that
#: thread never signals through a number the owner just closed (and the kernel reused).
_PIDFD_LOCK = threading.Lock()
_active: tuple[int, WorkerPool] | None = None


_PR_SET_CHILD_SUBREAPER = 36
#: ``pidfd_send_signal`` flag (Linux >= 6.9): signal the process group the pidfd's process leads.
_PIDFD_SIGNAL_PROCESS_GROUP = 4
#: Cleared when the kernel refuses that flag; the pool then uses the older rules.
_pidfd_groups = True


def _open_pidfd(h: WorkerHandle) -> None:
    """Name the just-forked Worker by a pidfd. ESRCH: it already exited and was reaped (its
    number may be free for reuse from now on)."""
    try:
        h.pidfd = os.pidfd_open(h.pid)
    except ProcessLookupError:
        h.reaped = True
    except (OSError, AttributeError):
        pass  # no pidfds here: the pool signals by number, as before


def _preload_problem(modules: list[str], timeout: float) -> str | None:
    """Import ``modules`` in a fresh interpreter, as the forkserver does (default ``sys.path`` +
    ``PYTHONPATH`` + working directory); the last line of its error, or None if they import.
    Without the warm-up's URL file (``apsup.workers.warm`` would take it)."""
    from apsup.workers.warm import ENV as WARM_ENV

    env = {k: v for k, v in os.environ.items() if k != WARM_ENV}
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, *modules],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return f"the imports did not finish within {timeout:g}s"
    except OSError:
        return None  # cannot tell (no fork for this either): transient
    if done.returncode == 0 or done.returncode < 0:
        return None  # imported, or the check itself was killed by a signal: not the modules
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return redact(lines[-1])[:300] if lines else f"exit status {done.returncode}"


def _pid_in_use(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux >= 3.4), so the Workers
    of a dead forkserver become our children instead of init's. False where unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _is_alive_child(pid: int | None) -> bool:
    """Whether our direct child ``pid`` has not exited; does not reap it (``WNOWAIT``), so
    the zygote's own ``stop`` can still reap it."""
    if pid is None:
        return False
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def _group_has_members(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a member (a zombie counts), by signal 0."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _forkserver_died(pid: int | None, settle: float = 1.0) -> bool:
    """After a status pipe hit EOF: did the forkserver die? A dying process closes its files
    before it becomes a zombie, so give it ``settle`` seconds to show as exited; one still
    alive after that wrote a real status of 255."""
    end = time.monotonic() + settle
    while _is_alive_child(pid):
        if time.monotonic() >= end:
            return False
        time.sleep(0.005)
    return True


class WorkerPool:
    """Worker processes of one host process: launch, deadlines, termination, confirmed exits.

    Not thread-safe: one owner (the Supervisor loop) drives it. The owner waits with
    ``apsup.workers.fds.readable(pool.sentinels() + [wakeup_fd], timeout)`` where the timeout
    comes from :meth:`next_deadline`, then calls :meth:`poll`.
    """

    def __init__(
        self,
        preload: Iterable[str],
        *,
        grace_seconds: float = 5.0,
        confirm_seconds: float = 5.0,
        launch_timeout: float = 30.0,
        start_timeout: float = 120.0,
    ) -> None:
        """Start the forkserver now and check that it really imported every ``preload`` module.

        ``grace_seconds``: SIGTERM-to-SIGKILL delay. ``confirm_seconds``: how long after SIGKILL
        a Worker without a confirmed exit becomes ``"unconfirmed"``. ``launch_timeout``: bound on
        the forkserver forking one Worker (see :class:`ForkServerStuck`). ``start_timeout``: bound
        on the forkserver's start, including importing the preload modules.
        Raises ``ConfigError`` if a preload module could not be imported in the forkserver (it
        sees the interpreter's default ``sys.path`` plus ``PYTHONPATH`` and the working
        directory, not ``sys.path`` edits made in this process).
        """
        global _active
        if grace_seconds < 0 or confirm_seconds < 0:
            raise ValueError("grace_seconds and confirm_seconds must be >= 0")
        if not (launch_timeout > 0 and start_timeout > 0):
            raise ValueError("launch_timeout and start_timeout must be > 0")
        self.grace_seconds = float(grace_seconds)
        self.confirm_seconds = float(confirm_seconds)
        self.launch_timeout = float(launch_timeout)
        self.start_timeout = float(start_timeout)
        self.preload: list[str] = list(dict.fromkeys([*preload, _CHILD_MODULE]))
        self._handles: dict[str, WorkerHandle] = {}
        self._closed = False
        #: Process groups of confirmed Workers whose stragglers we killed: as subreaper we
        #: also reap them (monotonic time after which we stop trying).
        self._reap_groups: dict[int, float] = {}
        self.subreaper = _become_subreaper()
        with _active_lock:
            if _active is not None:
                owner_pid, other = _active
                if owner_pid != os.getpid() and not other._closed:
                    raise RuntimeError(
                        "this process was forked from one that owns an open WorkerPool; "
                        "create WorkerPools only after forking (the forkserver is per process)"
                    )
                if owner_pid == os.getpid() and not other._closed:
                    raise RuntimeError(
                        "a WorkerPool is already open in this process: the forkserver and its "
                        "preload list are process-global, close() the other pool first"
                    )
            _active = (os.getpid(), self)
        self._zygote = Zygote(self.preload)
        try:
            self._start_and_verify()
        except BaseException:
            self._closed = True
            self._stop_forkserver(timeout=self.confirm_seconds)
            raise

    # --- lifecycle ---------------------------------------------------------------------------

    def _start_and_verify(self) -> None:
        """Start the forkserver by launching a probe, so the first real launch is cheap and a
        silently skipped preload (the forkserver ignores ImportError) becomes a startup error."""
        fd, report = tempfile.mkstemp(prefix="apsup-preload-", suffix=".txt")
        os.close(fd)
        try:
            payload = "\n".join([report, *self.preload]).encode()
            try:
                handle = self._launch(
                    "__preload_probe__",
                    f"{_CHILD_MODULE}:probe_preload",
                    payload,
                    self.start_timeout,
                    pid_timeout=self.start_timeout,
                )
            except ForkServerStuck as exc:
                raise ConfigError(
                    f"the Worker forkserver did not start within {self.start_timeout:g}s with "
                    f"preload {self.preload}: a preload module's import hangs (connecting to "
                    "something at import time?); preload modules must import without I/O"
                ) from exc
            except (OSError, EOFError) as exc:
                # The forkserver died before it forked the probe: a preload module that raises
                # at import (configuration), or a fork refused, or a signal (transient)? Import
                # the modules in a fresh interpreter to tell which.
                problem = _preload_problem(self.preload, self.start_timeout)
                if problem is not None:
                    raise ConfigError(
                        f"the Worker forkserver failed to start: a preload module raised at "
                        f"import ({problem}; preload {self.preload}); fix that module (an "
                        "import must not raise or do I/O)"
                    ) from exc
                raise WorkerStartError(
                    f"the Worker forkserver failed to start ({type(exc).__name__}: {exc}) "
                    "although its preload modules import fine: a fork refused by the kernel "
                    "or a signal during startup; retried"
                ) from exc
            exits = self._wait_for({handle.worker_id}, self.start_timeout + self.grace_seconds)
            with open(report, encoding="utf-8") as fh:
                missing = [line for line in fh.read().splitlines() if line]
        finally:
            with contextlib.suppress(OSError):
                os.unlink(report)
        if missing:
            raise ConfigError(
                f"Worker forkserver could not import preload module(s) {missing}: the forkserver "
                "uses the interpreter's default sys.path (+ PYTHONPATH, working directory), not "
                "this process's sys.path edits; install the package or set PYTHONPATH"
            )
        if not exits or exits[0].exitcode != ExitCode.SUCCESS:
            got = exits[0].reason if exits else "no confirmed exit"
            raise WorkerStartError(f"Worker forkserver probe failed ({got}); see stderr")

    def _wait_for(self, worker_ids: set[str], timeout: float) -> list[WorkerExit]:
        end = time.monotonic() + timeout
        exits: list[WorkerExit] = []
        while worker_ids & self._handles.keys():
            remaining = end - time.monotonic()
            if remaining <= 0:
                break
            readable(self.sentinels(), min(remaining, 0.5))
            exits.extend(e for e in self._collect() if e.worker_id in worker_ids)
        return exits

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def forkserver_pid(self) -> int | None:
        """Pid of the current forkserver (for health checks and tests)."""
        return self._zygote.pid

    def close(self) -> list[WorkerHandle]:
        """Terminate running Workers, stop the forkserver; return handles left unconfirmed."""
        global _active
        if self._closed:
            return []
        try:
            if self._handles:
                self.terminate_all(self.grace_seconds)
            abandoned = list(self._handles.values())
            for handle in abandoned:
                self._signal_group(handle, signal.SIGKILL)
                handle._popen.close()
                self._close_pidfd(handle)
            self._handles.clear()
            self._stop_forkserver(timeout=self.confirm_seconds)
        finally:
            self._closed = True
            with _active_lock:
                if _active is not None and _active[1] is self:
                    _active = None
        return abandoned

    def _stop_forkserver(self, timeout: float) -> None:
        """Bounded stop of the zygote: it exits when its alive pipe closes, else it is killed
        after ``timeout``; Workers it forked run on (adopted by this pool as subreaper)."""
        with self._zygote.lock:
            self._zygote.stop(timeout)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- launching ---------------------------------------------------------------------------

    def launch(self, worker_id: str, target: str, payload: bytes, timeout: float) -> WorkerHandle:
        """Fork a Worker running ``target(payload)`` with a deadline ``timeout`` seconds away,
        and wait for its pid.

        Only ``target`` (a ``"module:function"`` str) and ``payload`` (bytes) are sent; the
        function must be importable in the Worker (ideally preloaded). ``worker_id`` must not be
        in use by a Worker whose exit is unconfirmed. Raises :class:`ForkServerStuck` if the
        forkserver does not fork within ``launch_timeout`` (``start_timeout`` when this launch
        has to restart a dead forkserver). :meth:`submit` is the same without the wait.
        """
        return self._launch(worker_id, target, payload, timeout, pid_timeout=self.launch_timeout)

    def submit(self, worker_id: str, target: str, payload: bytes, timeout: float) -> WorkerHandle:
        """Send a launch to the forkserver and return at once, before the fork.

        The handle is ``"launching"`` (``pid`` 0) and holds capacity like a running Worker. Its
        sentinel is in :meth:`sentinels` and becomes readable when the pid arrives; :meth:`poll`
        then reads it, and the deadline counts from there. Stops requested meanwhile
        (:meth:`terminate`, :meth:`terminate_all`) reach it as soon as it has a pid. If the
        forkserver does not fork within ``launch_timeout`` (``start_timeout`` when this launch
        restarts it), :meth:`poll` kills it like :meth:`launch` does and reports the launch as a
        :class:`WorkerExit` with ``launch_error="ForkServerStuck"``; a forkserver that dies
        first gives ``launch_error="EOFError"``. Bad arguments raise at once, as in
        :meth:`launch`.
        """
        return self._submit(worker_id, target, payload, timeout, self.launch_timeout)

    def _launch(
        self, worker_id: str, target: str, payload: bytes, timeout: float, *, pid_timeout: float
    ) -> WorkerHandle:
        handle = self._submit(worker_id, target, payload, timeout, pid_timeout)
        while handle.state == "launching":
            remaining = handle.deadline - time.monotonic()
            if remaining > 0:
                ready = readable([handle.sentinel], remaining)
                if ready and self._complete(handle) is False:
                    self._drop_launch(handle)
                    raise EOFError("the forkserver closed the launch's pipe before its pid")
                continue
            if not self._unstick(handle):
                raise ForkServerStuck(f"forkserver did not fork within {pid_timeout:g}s")
        return handle

    def _unstick(self, h: WorkerHandle) -> bool:
        """``h``'s launch passed its deadline: kill the forkserver (a fork it performed later
        would be a Worker nobody supervises; the next launch starts a fresh one). True if the
        pid arrived after all (the Worker runs, adopted once its sentinel reports the death),
        else the launch is dropped."""
        self._stop_forkserver(timeout=0)
        # Its pipe is at EOF now, or holds the pid; the forked child may still hold the write
        # end for an instant (until it closes the forkserver's fds), hence the short wait. A
        # child it forked without reporting reports itself on the hold pipe.
        done: bool | None = None
        for _ in range(2):
            if not readable([h.sentinel], 1.0):
                break
            done = self._complete(h)
            if done is not None:
                break
        if done is None and h.orphan:
            return True  # a Worker may run: it holds its key until its pid or EOF arrives
        if done:
            return True
        self._drop_launch(h)
        return False

    def _submit(
        self, worker_id: str, target: str, payload: bytes, timeout: float, pid_timeout: float
    ) -> WorkerHandle:
        if self._closed:
            raise RuntimeError("WorkerPool is closed")
        if worker_id in self._handles:
            raise ValueError(f"worker_id {worker_id!r} is still running (exit not confirmed)")
        if type(payload) is not bytes:
            raise TypeError("payload must be bytes (orjson), nothing else crosses the boundary")
        if target.count(":") != 1:
            raise ValueError(f"target must be 'module:function', got {target!r}")
        if not timeout > 0:
            raise ValueError("timeout must be > 0")
        fs_pid = self.forkserver_pid
        if fs_pid is None or not _is_alive_child(fs_pid):
            # This launch (re)starts the zygote, preload imports included.
            pid_timeout = max(pid_timeout, self.start_timeout)
            with self._zygote.lock:
                if fs_pid is not None:
                    self._zygote.stop(0)  # reap the dead one, drop its socket
                self._zygote.start()
        sent = time.monotonic()
        hold_r, hold_w = os.pipe()
        try:
            # The deadline travels too: the Worker stops itself if no host is left to
            # (``apsup.workers.deadline``).
            status_r = self._zygote.send(
                target, payload, float(timeout), self.grace_seconds, hold_w, pid_timeout
            )
        except TimeoutError as exc:  # its listen queue is full: wedged
            os.close(hold_r)
            self._stop_forkserver(timeout=0)
            raise ForkServerStuck(f"forkserver did not accept within {pid_timeout:g}s") from exc
        except BaseException:
            os.close(hold_r)
            raise
        finally:
            os.close(hold_w)  # the zygote has its own copy now (or none: nothing was sent)
        popen = _Launch(status_r)
        handle = WorkerHandle(
            worker_id=worker_id,
            pid=0,
            target=target,
            started=sent,
            deadline=sent + pid_timeout,
            state="launching",
            timeout=float(timeout),
            hold=hold_r,
            _popen=popen,
            _forkserver_pid=self.forkserver_pid,
        )
        self._handles[worker_id] = handle
        return handle

    def _complete(self, h: WorkerHandle) -> bool | None:
        """Read a launching Worker's pid (its sentinel is readable): it is running from now on.

        If the forkserver closed the pipe without a pid (it died, maybe right after the fork),
        the Worker may still run: its own pid comes on the hold pipe. False if that pipe is at
        EOF without one (no Worker of this launch runs), None while neither has arrived yet
        (the sentinel is the hold pipe from now on)."""
        if not h.orphan:
            try:
                pid = read_signed(h.sentinel)
            except (OSError, EOFError):
                h.orphan = True
                if h.hold is None or not _readable(h.hold):
                    return None if h.hold is not None else False
        if h.orphan:
            try:
                if h.hold is None:
                    raise EOFError("no hold pipe")
                pid = read_signed(h.hold)
            except (OSError, EOFError):
                return False  # every holder is gone and none wrote a pid: nothing runs
            # Its forkserver is gone: only our own waitpid (as subreaper) can confirm it.
            h._status = _FORKSERVER_EOF_EXITCODE
        started = time.monotonic()
        h.pid, h.state, h.started, h.deadline = pid, "running", started, started + h.timeout
        h._popen.pid = pid
        _open_pidfd(h)
        if _readable(h.sentinel):
            # Its exit status is there already (or the forkserver is gone): read it now. A real
            # status means the forkserver reaped it, maybe before the pidfd was opened, so that
            # pidfd could name a process that reused the number: drop it.
            h._status = self._read_status(h)
            if h._status != _FORKSERVER_EOF_EXITCODE:
                self._close_pidfd(h)
                h.reaped = True
        if h.terminated and h._status in (None, _FORKSERVER_EOF_EXITCODE):
            self._signal_group(h, signal.SIGTERM)  # a stop requested while it was launching
            h.state, h.term_sent_at = "terminating", started
        return True

    def _drop_launch(self, h: WorkerHandle) -> None:
        """Forget a launch that produced no Worker."""
        self._handles.pop(h.worker_id, None)
        h._popen.close()
        self._close_hold(h)

    @staticmethod
    def _close_hold(h: WorkerHandle) -> None:
        if h.hold is not None:
            with contextlib.suppress(OSError):
                os.close(h.hold)
            h.hold = None

    def _launch_failed(self, h: WorkerHandle, error: str, now: float | None) -> WorkerExit:
        self._drop_launch(h)
        at = time.monotonic() if now is None else now
        return WorkerExit(
            worker_id=h.worker_id,
            exitcode=int(ExitCode.STATUS_LOST),
            signal=None,
            timed_out=False,
            duration=at - h.started,
            pid=0,
            terminated=h.terminated,
            launch_error=error,
        )

    @staticmethod
    def _read_status(h: WorkerHandle) -> int:
        """The exit status the forkserver wrote (its sentinel is readable); 255 at EOF."""
        try:
            return int(read_signed(h.sentinel))
        except (OSError, EOFError):
            return _FORKSERVER_EOF_EXITCODE

    @staticmethod
    def _close_pidfd(h: WorkerHandle) -> None:
        with _PIDFD_LOCK:  # never while another thread signals through it (``signal_from``)
            if h.pidfd is not None:
                with contextlib.suppress(OSError):
                    os.close(h.pidfd)
                h.pidfd = None

    def signal_from_thread(self, worker_ids: Iterable[str], sig: int) -> int:
        """Signal these Workers' process groups from a thread other than the owner's (the
        lease watchdog, while the owner's loop may be blocked). Only signals: the owner's next
        :meth:`poll` or :meth:`terminate` does the accounting. Returns how many were signalled.
        """
        wanted = set(worker_ids)
        sent = 0
        with _PIDFD_LOCK:
            for h in list(self._handles.values()):
                if h.worker_id in wanted and h.pid > 0 and not (h.status_lost or h.reaped):
                    self._signal_group(h, sig)
                    sent += 1
        return sent

    # --- observing ---------------------------------------------------------------------------

    def running(self) -> list[WorkerHandle]:
        """Every Worker still holding capacity, including ``"unconfirmed"`` ones."""
        return list(self._handles.values())

    def __len__(self) -> int:
        return len(self._handles)

    def sentinels(self) -> list[int]:
        """Fds that become readable when a Worker's exit status arrives. Excludes Workers whose
        forkserver died (their pipe is at EOF and would wake the owner forever)."""
        return [
            h.sentinel
            for h in self._handles.values()
            if not h.status_lost and (not h.adopted or h.pidfd is not None)
        ]

    def settle_launches(self, ready: Iterable[int]) -> bool:
        """Read the pids of launching Workers whose sentinels are in ``ready`` (fds a wait
        returned). True if that was all there was to do: every fd was a launch's and none
        brought an exit or a failure, so the owner may go back to waiting without a
        :meth:`poll` (which would handle anything else, the same way)."""
        ready = list(ready)
        launching = {h.sentinel: h for h in self._handles.values() if h.state == "launching"}
        if not launching or any(fd not in launching for fd in ready):
            return False
        settled = True
        for fd in ready:
            h = launching[fd]
            if not self._complete(h) or h._status is not None:
                settled = False  # a failed launch or an exit already: poll() reports it
        return settled

    def next_deadline(self) -> float | None:
        """Monotonic time of the next timeout/grace/confirm step; ``None`` if nothing is due."""
        times: list[float] = []
        for h in self._handles.values():
            if h.status_lost:
                continue
            if h.adopted and h.pidfd is None:
                times.append(time.monotonic() + 0.2)  # no pidfd: poll its waitpid
            if h.orphan and h.state == "launching":
                continue  # awaiting its pid on the hold pipe (in the wait set), no deadline
            if h.state in ("running", "launching"):
                times.append(h.deadline)
            elif h.state == "terminating" and h.term_sent_at is not None:
                times.append(h.term_sent_at + self.grace_seconds)
            elif h.state == "killing" and h.kill_sent_at is not None:
                times.append(h.kill_sent_at + self.confirm_seconds)
        return min(times, default=None)

    def poll(self, now: float | None = None) -> list[WorkerExit]:
        """Reap every Worker whose exit is confirmed, then advance deadlines one step each
        (SIGTERM at the deadline, SIGKILL after the grace, ``"unconfirmed"`` after confirm)."""
        exits = self._collect(now)
        now = time.monotonic() if now is None else now
        for h in list(self._handles.values()):
            self._enforce(h, now)
        self._reap_stragglers(now)
        self._reap_dead_forkserver()
        return exits

    def _reap_dead_forkserver(self) -> None:
        """A forkserver that died (killed, crashed) is our child: reap it now, not at the next
        launch (an idle host might never launch again and keep a zombie for life). Its Workers
        were adopted by ``_collect`` already (their status pipes reported the death first);
        launches still waiting for a pid keep it until they are settled."""
        pid = self.forkserver_pid
        if pid is None or _is_alive_child(pid):
            return
        if any(h.state == "launching" and not h.orphan for h in self._handles.values()):
            return
        self._stop_forkserver(timeout=0)

    def unconfirmed(self) -> list[WorkerHandle]:
        """Workers whose exit we may never confirm: still holding capacity, nothing to wait on."""
        return [h for h in self._handles.values() if h.state == "unconfirmed"]

    # --- termination -------------------------------------------------------------------------

    def terminate(self, worker_ids: Iterable[str] | None = None, now: float | None = None) -> None:
        """Non-blocking stop for an event loop: SIGTERM these Workers' groups (all if ``None``)
        now; later :meth:`poll` calls SIGKILL them after ``grace_seconds`` and report the exits
        with ``terminated=True``. Unknown or already-stopping Workers are left as they are."""
        now = time.monotonic() if now is None else now
        ids = list(self._handles) if worker_ids is None else list(worker_ids)
        for wid in ids:
            h = self._handles.get(wid)
            if h is None or h.status_lost:
                continue
            h.terminated = True  # a launching Worker is signalled once its pid arrives
            if h.state == "running":
                self._signal_group(h, signal.SIGTERM)
                h.state, h.term_sent_at = "terminating", now

    def terminate_all(self, grace: float) -> list[WorkerExit]:
        """Blocking shutdown / lease loss: SIGTERM every group, wait up to ``grace``, SIGKILL the
        rest, wait up to ``confirm_seconds`` for confirmation. Returns the exits confirmed
        meanwhile; Workers still unconfirmed stay in the pool as ``"unconfirmed"``."""
        exits = self._collect()
        now = time.monotonic()
        self.terminate(now=now)
        exits.extend(self._wait_confirmed(now + grace))
        launching = [h for h in self._handles.values() if h.state == "launching"]
        if launching:
            # No pid within the grace: stop the forkserver so that it forks none of them later.
            self._stop_forkserver(timeout=0)
            for h in launching:
                if not (readable([h.sentinel], 1.0) and self._complete(h)):
                    if h.orphan and h.hold is not None and not _readable(h.hold):
                        continue  # a Worker may run: it stays, unconfirmed, below
                    exits.append(self._launch_failed(h, "ForkServerStuck", None))
        now = time.monotonic()
        for h in self._handles.values():
            if not h.status_lost and h.state in ("running", "terminating"):
                self._signal_group(h, signal.SIGKILL)
                h.state, h.kill_sent_at = "killing", now
        exits.extend(self._wait_confirmed(now + self.confirm_seconds))
        for h in self._handles.values():
            h.state = "unconfirmed"
        return exits

    def _wait_confirmed(self, until: float) -> list[WorkerExit]:
        exits: list[WorkerExit] = []
        while True:
            exits.extend(self._collect())
            sentinels = self.sentinels()
            remaining = until - time.monotonic()
            if not sentinels or remaining <= 0:
                return exits
            readable(sentinels, remaining)

    # --- internals ---------------------------------------------------------------------------

    def _collect(self, now: float | None = None) -> list[WorkerExit]:
        exits: list[WorkerExit] = []
        for h in [h for h in self._handles.values() if h.adopted]:
            code = self._wait_adopted(h)
            if code is not None:
                exits.append(self._confirmed(h, code, now))
        live = [h for h in self._handles.values() if not h.status_lost and not h.adopted]
        if not live:
            return exits
        ready = set(readable([h.sentinel for h in live], 0))
        for h in live:
            if h.state == "launching":
                if h.sentinel in ready:
                    done = self._complete(h)
                    if done is False:
                        exits.append(self._launch_failed(h, "EOFError", now))
                        continue
                    if done is None:
                        continue  # its forkserver died after the fork: awaiting the pid
                elif h.orphan:
                    continue
                elif time.monotonic() >= h.deadline and not self._unstick(h):
                    exits.append(self._launch_failed(h, "ForkServerStuck", now))
                    continue
                if h.state == "launching" or h._status is None:
                    continue  # running now; its exit status is not there yet
            elif h._status is None and h.sentinel not in ready:
                continue  # (a status read with the pid is confirmed whether or not at EOF yet)
            exitcode = h._status
            if exitcode is None:
                exitcode = h._status = self._read_status(h)
            if exitcode == _FORKSERVER_EOF_EXITCODE and _forkserver_died(h._forkserver_pid):
                if not self._adopt(h):
                    self._mark_status_lost(h)
                    continue
                code = self._wait_adopted(h)
                if code is None:
                    continue  # still running: confirmed later through its pidfd
                exitcode = code
            exits.append(self._confirmed(h, int(exitcode), now))
        return exits

    def _confirmed(self, h: WorkerHandle, exitcode: int, now: float | None) -> WorkerExit:
        at = time.monotonic() if now is None else now
        del self._handles[h.worker_id]
        h.reaped = True  # the forkserver (or we, adopted) reaped it: its status is here
        h._popen.close()
        self._close_hold(h)
        if not any(other.pid == h.pid for other in self._handles.values()):
            # Stragglers in its group (grandchildren that ignored SIGTERM or were simply
            # left behind) die with it; ``_signal_group`` never reaches a reused group.
            self._signal_group(h, signal.SIGKILL, group_only=True)
            if self.subreaper and _group_has_members(h.pid):
                # Only a group with members left (killed stragglers, zombies included) has
                # anything to reap; an empty group can never gain one. Registering every
                # confirmed Worker made each poll() scan all exits of the last 10 s (10% of
                # the host loop's CPU at ~100 exits/s).
                self._reap_groups[h.pid] = at + 10.0
        self._close_pidfd(h)
        return WorkerExit(
            worker_id=h.worker_id,
            exitcode=exitcode,
            signal=-exitcode if exitcode < 0 else None,
            # Stopped past deadline + grace while we had not acted (our loop was blocked): the
            # Worker's own deadline stopped it (``apsup.workers.deadline``), a timeout too.
            timed_out=h.timed_out
            or (exitcode in _STOP_CODES and at >= h.deadline + self.grace_seconds),
            duration=at - h.started,
            pid=h.pid,
            terminated=h.terminated,
        )

    def _adopt(self, h: WorkerHandle) -> bool:
        """The forkserver is dead: take over confirming ``h`` (we are its reaper now)."""
        if not self.subreaper:
            return False
        h.adopted = True
        if h.pidfd is not None:
            return True  # the pidfd of the launch names it still (it is unreaped, our child)
        try:
            h.pidfd = os.pidfd_open(h.pid)
        except (OSError, AttributeError):
            h.pidfd = None  # exited already (reaped below) or no pidfds: poll instead
        return True

    def _wait_adopted(self, h: WorkerHandle) -> int | None:
        """Exit code of an adopted Worker once it has exited, else None. A Worker that is not
        our child any more was reaped by the forkserver before it died: gone, status lost."""
        try:
            pid, status = os.waitpid(h.pid, os.WNOHANG)
        except ChildProcessError:
            return int(ExitCode.STATUS_LOST)
        if pid == 0:
            return None
        return os.waitstatus_to_exitcode(status)

    def _reap_stragglers(self, now: float) -> None:
        """Reap what we killed in confirmed Workers' groups (reparented to us as subreaper)."""
        for pgid, until in list(self._reap_groups.items()):
            try:
                while os.waitid(os.P_PGID, pgid, os.WEXITED | os.WNOHANG) is not None:
                    pass
            except ChildProcessError:
                if now >= until:
                    del self._reap_groups[pgid]
                continue
            if now >= until:
                del self._reap_groups[pgid]

    def _mark_status_lost(self, h: WorkerHandle) -> None:
        """The forkserver died before reporting this Worker: its exit can never be confirmed.
        Keep it as ``"unconfirmed"`` (no second Worker for its key this term) and kill its group
        so the orphaned work at least stops."""
        h.status_lost = True
        h.state = "unconfirmed"
        self._signal_group(h, signal.SIGKILL)

    def _enforce(self, h: WorkerHandle, now: float) -> None:
        if h.status_lost:
            return
        if h.state == "running" and now >= h.deadline:
            h.timed_out = True
            self._signal_group(h, signal.SIGTERM)
            h.state, h.term_sent_at = "terminating", now
        elif (
            h.state == "terminating"
            and h.term_sent_at is not None
            and now >= h.term_sent_at + self.grace_seconds
        ):
            self._signal_group(h, signal.SIGKILL)
            h.state, h.kill_sent_at = "killing", now
        elif (
            h.state == "killing"
            and h.kill_sent_at is not None
            and now >= h.kill_sent_at + self.confirm_seconds
        ):
            h.state = "unconfirmed"

    @staticmethod
    def _signal_group(h: WorkerHandle, sig: int, *, group_only: bool = False) -> None:
        """Signal the Worker's process group; before the child's ``setsid`` (the group does not
        exist yet) the Worker alone, unless only the group is wanted.

        Never a recycled group. The forkserver reaps a Worker before its status reaches us, and
        from then on its number is free once its group is empty: a ``killpg`` on that number
        could hit the group of an unrelated process that got the number and called ``setsid``
        (another Worker, say). So the pool signals through the pidfd opened at launch, which
        names the Worker's process itself, not a number:

        - Linux >= 6.9: ``pidfd_send_signal`` with ``PIDFD_SIGNAL_PROCESS_GROUP`` reaches exactly
          the group the Worker created, also after the Worker was reaped while stragglers
          remain, and nothing once that group is gone: exact, no race.
        - Older kernels: ``killpg`` only while the pidfd shows the Worker unreaped (a live or
          zombie process keeps its number), or, once it is reaped, only while no process has
          its number (a number cannot be reused while stragglers keep it as their pgid, so a
          process with that number means our group is gone).
        - Without pidfds: ``killpg`` as long as the exit is unconfirmed; after it, the second
          rule alone.
        """
        global _pidfd_groups
        if h.pid <= 0:
            return  # not forked yet (``"launching"``): no process to signal; 0 is our own group
        fd = h.pidfd
        if fd is not None and _pidfd_groups:
            try:
                signal.pidfd_send_signal(fd, sig, None, _PIDFD_SIGNAL_PROCESS_GROUP)
                return
            except ProcessLookupError:
                pass  # no group (before ``setsid``) or it is empty
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    return
                _pidfd_groups = False  # an older kernel: the rules below
            if _pidfd_groups:
                if not group_only:
                    with contextlib.suppress(OSError):
                        signal.pidfd_send_signal(fd, sig)
                return
        reaped = h.reaped
        if fd is not None and not reaped:
            try:
                signal.pidfd_send_signal(fd, 0)
            except ProcessLookupError:
                reaped = True
            except OSError:
                pass
        if reaped and _pid_in_use(h.pid):
            return  # the number names another process now: our group is gone
        try:
            os.killpg(h.pid, sig)
            return
        except ProcessLookupError:
            if group_only or reaped:
                return
        except PermissionError:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(h.pid, sig)
