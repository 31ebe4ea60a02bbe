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
(see ``apsup.workers.processes.signal_group``). The Worker also carries its deadline and stops
itself if no host is left to (``apsup.workers.deadline``).

Process-global state: the pool makes its owner a child subreaper, so only one open
``WorkerPool`` may exist per process, and a pool must be created after any fork of its owner
(the dedicated-mode launcher must fork Supervisors first; each creates its own pool).

Launches do not wait for the fork (``WorkerPool.submit``): the pid arrives on the same pipe as
the exit status, so the owner waits on it with the exits and the pool reads it in ``poll``; the
Worker's deadline counts from then. Measured at 8 Workers (300 no-op invocations, loaded 2-core
machine): the host loop spent 3.9 s of 5.1 s blocked in launches and all 8 Workers were in
flight 21% of the time; pipelined, 0.35 s and 90%.

The launcher is apsup's own (``apsup.workers.zygote``): one message per launch, the child calls
the Worker's entry point directly. This module keeps the accounting (capacity, deadlines,
termination, confirmation, adoption) and nothing else: reading a launch's pipes is
``apsup.workers.launches``, signalling and questions about processes ``apsup.workers.processes``,
the handle and exit records ``apsup.workers.handles``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterable
from types import TracebackType

from apsup.errors import ConfigError, WorkerStartError
from apsup.workers.exit_codes import ExitCode
from apsup.workers.fds import read_verdict, readable
from apsup.workers.handles import (
    FORKSERVER_EOF_EXITCODE,
    STOP_CODES,
    ForkServerStuck,
    StatusPipe,
    WorkerExit,
    WorkerHandle,
    WorkerState,
)
from apsup.workers.launches import close_hold, complete, preload_problem, read_status
from apsup.workers.processes import (
    PIDFD_LOCK,
    become_subreaper,
    close_pidfd,
    forkserver_died,
    group_has_members,
    is_alive_child,
    signal_group,
)
from apsup.workers.zygote import Zygote

__all__ = ["ForkServerStuck", "WorkerExit", "WorkerHandle", "WorkerPool", "WorkerState"]


_CHILD_MODULE = "apsup.workers.child"


_active_lock = threading.Lock()
_active: tuple[int, WorkerPool] | None = None


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
        self.subreaper = become_subreaper()
        #: Why the zygote forks Workers with ``os.fork()`` instead of its lean fork
        #: (``apsup.workers.fork``), as its startup probe found; None when lean (or no lean
        #: fork exists on this platform).
        self.fork_note: str | None = None
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
                problem = preload_problem(self.preload, self.start_timeout)
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
                note, *rest = fh.read().split("\n")
            missing = [line for line in rest if line]
            self.fork_note = note or None
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
                signal_group(handle, signal.SIGKILL)
                handle._popen.close()
                close_pidfd(handle)
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

    def submit(
        self,
        worker_id: str,
        target: str,
        payload: bytes,
        timeout: float,
        fds: tuple[int, ...] = (),
    ) -> WorkerHandle:
        """Send a launch to the forkserver and return at once, before the fork.

        The handle is ``"launching"`` (``pid`` 0) and holds capacity like a running Worker. Its
        sentinel is in :meth:`sentinels` and becomes readable when the pid arrives; :meth:`poll`
        then reads it, and the deadline counts from there. Stops requested meanwhile
        (:meth:`terminate`, :meth:`terminate_all`) reach it as soon as it has a pid. If the
        forkserver does not fork within ``launch_timeout`` (``start_timeout`` when this launch
        restarts it), :meth:`poll` kills it like :meth:`launch` does and reports the launch as a
        :class:`WorkerExit` with ``launch_error="ForkServerStuck"``; a forkserver that dies
        first gives ``launch_error="EOFError"``. Bad arguments raise at once, as in
        :meth:`launch`. ``fds`` (at most 8) are passed to the Worker with the launch
        (``apsup.workers.child.launch_fds``); the caller keeps and closes its own copies.
        """
        if len(fds) > 8:
            raise ValueError("at most 8 fds travel with a launch")
        return self._submit(worker_id, target, payload, timeout, self.launch_timeout, fds)

    def _launch(
        self, worker_id: str, target: str, payload: bytes, timeout: float, *, pid_timeout: float
    ) -> WorkerHandle:
        handle = self._submit(worker_id, target, payload, timeout, pid_timeout)
        while handle.state == "launching":
            remaining = handle.deadline - time.monotonic()
            if remaining > 0:
                ready = readable([handle.sentinel], remaining)
                if ready and complete(handle) is False:
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
            done = complete(h)
            if done is not None:
                break
        if done is None and h.orphan:
            return True  # a Worker may run: it holds its key until its pid or EOF arrives
        if done:
            return True
        self._drop_launch(h)
        return False

    def _submit(
        self,
        worker_id: str,
        target: str,
        payload: bytes,
        timeout: float,
        pid_timeout: float,
        fds: tuple[int, ...] = (),
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
        if fs_pid is None or not is_alive_child(fs_pid):
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
                target, payload, float(timeout), self.grace_seconds, hold_w, pid_timeout, fds
            )
        except TimeoutError as exc:  # its channel stays full: wedged
            os.close(hold_r)
            self._stop_forkserver(timeout=0)
            raise ForkServerStuck(f"forkserver did not accept within {pid_timeout:g}s") from exc
        except BaseException:
            os.close(hold_r)
            raise
        finally:
            os.close(hold_w)  # the zygote has its own copy now (or none: nothing was sent)
        popen = StatusPipe(status_r)
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

    def _drop_launch(self, h: WorkerHandle) -> None:
        """Forget a launch that produced no Worker."""
        self._handles.pop(h.worker_id, None)
        h._popen.close()
        close_hold(h)

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

    def signal_from_thread(self, worker_ids: Iterable[str], sig: int) -> int:
        """Signal these Workers' process groups from a thread other than the owner's (the
        lease watchdog, while the owner's loop may be blocked). Only signals: the owner's next
        :meth:`poll` or :meth:`terminate` does the accounting. Returns how many were signalled.
        """
        wanted = set(worker_ids)
        sent = 0
        with PIDFD_LOCK:
            for h in list(self._handles.values()):
                if h.worker_id in wanted and h.pid > 0 and not (h.status_lost or h.reaped):
                    signal_group(h, sig)
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
            if not complete(h) or h._status is not None:
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
        if pid is None or is_alive_child(pid):
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
                signal_group(h, signal.SIGTERM)
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
                if not (readable([h.sentinel], 1.0) and complete(h)):
                    if h.orphan and h.hold is not None and not readable([h.hold], 0):
                        continue  # a Worker may run: it stays, unconfirmed, below
                    exits.append(self._launch_failed(h, "ForkServerStuck", None))
        now = time.monotonic()
        for h in self._handles.values():
            if not h.status_lost and h.state in ("running", "terminating"):
                signal_group(h, signal.SIGKILL)
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
                    done = complete(h)
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
                exitcode = h._status = read_status(h)
            if exitcode == FORKSERVER_EOF_EXITCODE and forkserver_died(h._forkserver_pid):
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
        vouched = h.hold is not None and read_verdict(h.hold) == exitcode
        close_hold(h)
        if not any(other.pid == h.pid for other in self._handles.values()):
            # Stragglers in its group (grandchildren that ignored SIGTERM or were simply
            # left behind) die with it; ``signal_group`` never reaches a reused group.
            signal_group(h, signal.SIGKILL, group_only=True)
            if self.subreaper and group_has_members(h.pid):
                # Only a group with members left (killed stragglers, zombies included) has
                # anything to reap; an empty group can never gain one. Registering every
                # confirmed Worker made each poll() scan all exits of the last 10 s (10% of
                # the host loop's CPU at ~100 exits/s).
                self._reap_groups[h.pid] = at + 10.0
        close_pidfd(h)
        return WorkerExit(
            worker_id=h.worker_id,
            exitcode=exitcode,
            signal=-exitcode if exitcode < 0 else None,
            # Stopped past deadline + grace while we had not acted (our loop was blocked): the
            # Worker's own deadline stopped it (``apsup.workers.deadline``), a timeout too.
            timed_out=h.timed_out
            or (exitcode in STOP_CODES and at >= h.deadline + self.grace_seconds),
            duration=at - h.started,
            pid=h.pid,
            terminated=h.terminated,
            vouched=vouched,
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
        signal_group(h, signal.SIGKILL)

    def _enforce(self, h: WorkerHandle, now: float) -> None:
        if h.status_lost:
            return
        if h.state == "running" and now >= h.deadline:
            h.timed_out = True
            signal_group(h, signal.SIGTERM)
            h.state, h.term_sent_at = "terminating", now
        elif (
            h.state == "terminating"
            and h.term_sent_at is not None
            and now >= h.term_sent_at + self.grace_seconds
        ):
            signal_group(h, signal.SIGKILL)
            h.state, h.kill_sent_at = "killing", now
        elif (
            h.state == "killing"
            and h.kill_sent_at is not None
            and now >= h.kill_sent_at + self.confirm_seconds
        ):
            h.state = "unconfirmed"
