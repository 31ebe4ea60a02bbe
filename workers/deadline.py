"""A Worker's own deadline: the backstop that stops a Worker when no host is left to stop it.

The host's pool enforces every deadline (SIGTERM to the Worker's process group at the deadline,
SIGKILL after the grace). A host killed with SIGKILL, or one that hangs, can do neither, and
its running Workers would run for ever. So each Worker also carries its timeout and the pool's
grace, and arms two kernel timers (``timer_create``) as it starts. Kernel timers fire whatever
the main thread is doing, survive the death of every other process, and are not inherited by
the Worker's own children:

- Timer A fires ``timeout + grace`` after the start, when a living host would already have sent
  SIGKILL, then every ``grace``. Its signal (:data:`DEADLINE_SIGNAL`, a real-time signal no
  library uses) runs a handler that does what the host would have done: first SIGTERM to the
  Worker's whole process group (graceful: ``WorkerTerminated`` in the Worker, ``finally`` blocks
  roll back), one grace later SIGKILL to the group (grandchildren included).
- Timer B sends SIGKILL to the Worker itself ``timeout + 2 * grace + 1`` after the start: the
  hard stop from the kernel, for a Worker whose interpreter cannot run a signal handler any
  more (stuck inside C code).

A healthy host always acts a whole grace period earlier, so it stays the one that stops its
Workers and classifies their exits; the backstop only ever stops a Worker nobody else stops.
Where the timers are unavailable (not Linux/glibc), nothing is armed and only the host enforces.
"""

from __future__ import annotations

import _signal
import contextlib
import ctypes
import math
import os
import signal
from types import FrameType

#: The real-time signal of the Worker's graceful deadline stage (reserved in Workers).
DEADLINE_SIGNAL = signal.SIGRTMIN + 4
#: Extra seconds between the group SIGKILL by the handler and the kernel's SIGKILL (timer B).
HARD_STOP_MARGIN = 1.0
#: Longest timer set (a year): larger timeouts are effectively unlimited.
_MAX_SECONDS = 365 * 24 * 3600.0

_CLOCK_MONOTONIC = 1
_SIGEV_SIGNAL = 0


class _SigEvent(ctypes.Structure):
    # struct sigevent is 64 bytes on Linux: sigval, signo, notify, then a union (padding).
    _fields_ = [
        ("sigev_value", ctypes.c_void_p),
        ("sigev_signo", ctypes.c_int),
        ("sigev_notify", ctypes.c_int),
        ("_pad", ctypes.c_int * 14),
    ]


class _TimeSpec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _ITimerSpec(ctypes.Structure):
    _fields_ = [("it_interval", _TimeSpec), ("it_value", _TimeSpec)]


def _load_timer_functions() -> tuple[object, object] | None:
    """``timer_create``/``timer_settime`` from libc (glibc >= 2.34) or librt; resolved once at
    import (in the forkserver), so arming costs a Worker only four system calls.

    Untyped, without ``use_errno``: a Worker makes these calls first thing, when every page
    ctypes touches is a copy; declared argument types and the errno swap would copy more. Every
    argument passed is a ctypes object (``byref``, ``c_void_p``),
    ``None`` (NULL) or a small int (an ``int`` parameter), so no conversion is needed; errno is
    not read (a failed call only leaves the timer unarmed)."""
    for name in (None, "librt.so.1"):
        try:
            lib = ctypes.CDLL(name)
            create, settime = lib.timer_create, lib.timer_settime
        except (OSError, AttributeError):
            continue
        create.restype = ctypes.c_int
        settime.restype = ctypes.c_int
        return create, settime
    return None


_TIMERS = _load_timer_functions()
_armed = False
_fired = 0


class _Timer:
    """One kernel timer's arguments, built at import (in the forkserver): a Worker only fills in
    the times, since every object it creates after the fork costs it fresh memory pages."""

    def __init__(self, signo: int) -> None:
        self.event = _SigEvent(sigev_signo=signo, sigev_notify=_SIGEV_SIGNAL)
        self.timer = ctypes.c_void_p()
        self.spec = _ITimerSpec()
        self.refs = (ctypes.byref(self.event), ctypes.byref(self.timer), ctypes.byref(self.spec))

    def arm(self, first: float, every: float) -> bool:
        if _TIMERS is None:
            return False
        create, settime = _TIMERS
        _set(self.spec.it_value, first)
        _set(self.spec.it_interval, every)
        event, timer, spec = self.refs
        if create(_CLOCK_MONOTONIC, event, timer) != 0:  # type: ignore[operator]
            return False
        return settime(self.timer, 0, spec, None) == 0  # type: ignore[operator]


def _set(ts: _TimeSpec, seconds: float) -> None:
    seconds = min(max(seconds, 0.0), _MAX_SECONDS)
    whole = int(seconds)
    ts.tv_sec = whole
    ts.tv_nsec = int((seconds - whole) * 1e9)


_GRACEFUL = _Timer(DEADLINE_SIGNAL)
_HARD = _Timer(signal.SIGKILL)


def _on_deadline(signum: int, frame: FrameType | None) -> None:
    """Timer A: first SIGTERM to the Worker's group, then SIGKILL to it at every later tick."""
    global _fired
    if not _armed:
        return  # not a Worker (the forkserver or the host, which import this module)
    _fired += 1
    sig = signal.SIGTERM if _fired == 1 else signal.SIGKILL
    with contextlib.suppress(OSError):
        if os.getpgid(0) == os.getpid():  # our own group (``setsid``): grandchildren too
            os.killpg(os.getpid(), sig)
        else:
            os.kill(os.getpid(), sig)


def arm(timeout: float | None, grace: float) -> bool:
    """Arm this Worker's own deadline (see the module docstring); call once, in the Worker,
    after ``setsid``. Returns whether the timers are armed."""
    global _armed
    if timeout is None or not math.isfinite(timeout) or timeout <= 0:
        return False
    grace = max(float(grace), 0.1)
    first = float(timeout) + grace
    if first >= _MAX_SECONDS:
        return False
    _armed = True
    if _signal.getsignal(DEADLINE_SIGNAL) is not _on_deadline:  # no enum conversion
        _signal.signal(DEADLINE_SIGNAL, _on_deadline)
    if not _GRACEFUL.arm(first, grace):
        return False
    return _HARD.arm(first + grace + HARD_STOP_MARGIN, 0.0)


# Installed here, at import in the forkserver's main thread, so a Worker inherits the handler
# instead of paying for ``signal.signal`` itself; it does nothing until ``arm`` ran in that process.
with contextlib.suppress(ValueError):  # imported outside the main thread: ``arm`` installs it
    signal.signal(DEADLINE_SIGNAL, _on_deadline)
