"""How the zygote forks a Worker: libc's ``fork()`` when that is safe, ``os.fork()`` otherwise.

``os.fork()`` runs the interpreter's after-fork work in the child before it returns: it
re-creates the runtime's locks for the one thread that survives, then calls every hook that
modules registered with ``os.register_at_fork`` (threading's bookkeeping, logging's handler
locks, random's reseed). All of that exists for a process whose other threads held locks at the
fork. The zygote has no other thread, so it changes nothing a Worker relies on, yet it runs
code the zygote never ran, in a fresh child: 0.6-0.8 ms of CPU and ~190 copied memory pages per
invocation, more than the Worker's whole SQLite transaction.

So the zygote calls libc's ``fork()`` directly (through ``ctypes.PyDLL``, which keeps holding
the GIL across the call: the child's one thread continues with the interpreter state it had),
but only while all of this holds, checked at every launch:

- the process has exactly one thread (``/proc/self/task``): no lock can be held by a thread that
  will not exist in the child;
- every ``os.register_at_fork`` hook was registered by ``threading``, ``random`` or
  ``logging`` (:func:`watch_hooks` records the others: a preloaded family module may register
  one that must run, and then every fork is an ``os.fork()``). Those three only matter with
  other threads, except random's reseed, which the Worker does itself first thing
  (``apsup.workers.child``);
- CPython 3.11-3.13 with the GIL on Linux with glibc, where this was verified.

The child is a new process either way: a fresh address space, fenced writes, the same deadline.
"""

from __future__ import annotations

import ctypes
import os
import sys
import sysconfig
from collections.abc import Callable
from typing import Any

#: Modules whose at-fork hooks a single-threaded zygote may skip (see the module docstring).
_KNOWN_HOOK_MODULES = frozenset({"threading", "random", "logging"})

#: Hooks registered by other modules since :func:`watch_hooks` (their ``__module__``).
foreign_hooks: list[str] = []
#: In a Worker: whether the zygote forked it with libc's ``fork()`` (None: not forked by it).
forked_lean: bool | None = None


def _load_libc_fork() -> Callable[[], int] | None:
    if (
        sys.implementation.name != "cpython"
        or not (3, 11) <= sys.version_info[:2] <= (3, 13)
        or sysconfig.get_config_var("Py_GIL_DISABLED")
        or not sys.platform.startswith("linux")
    ):
        return None
    try:
        libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL stays held during the call
        fork = libc.fork
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: its fork() is the one verified
    except (OSError, AttributeError):
        return None
    fork.restype = ctypes.c_int
    fork.argtypes = []
    return fork  # type: ignore[no-any-return]


_libc_fork = _load_libc_fork()


def watch_hooks() -> None:
    """Record ``os.register_at_fork`` hooks of other modules from now on (the zygote calls this
    before importing the preload modules)."""
    original = os.register_at_fork
    if getattr(original, "_apsup_watch", False):
        return

    def register_at_fork(**hooks: Any) -> None:
        for hook in hooks.values():
            module = getattr(hook, "__module__", None)
            if module not in _KNOWN_HOOK_MODULES:
                foreign_hooks.append(str(module))
        original(**hooks)

    register_at_fork._apsup_watch = True  # type: ignore[attr-defined]
    os.register_at_fork = register_at_fork


def _single_threaded() -> bool:
    """``/proc/self/task`` has one link per thread plus two (one ``stat``: ~3 us)."""
    try:
        return os.stat("/proc/self/task").st_nlink == 3
    except OSError:
        return False


def lean_fork_possible() -> bool:
    return _libc_fork is not None and not foreign_hooks and _single_threaded()


def fork() -> tuple[int, bool]:
    """Fork; returns ``(pid, lean)`` where ``lean`` says libc's ``fork()`` was used (0 in the
    child, as ``os.fork``). ``OSError`` if the process cannot fork."""
    if _libc_fork is not None and lean_fork_possible():
        pid = _libc_fork()
        if pid >= 0:
            return pid, True
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return os.fork(), False
