"""What every benchmark does with the processes and servers it starts: nothing outlives it.

A benchmark that is stopped (SIGTERM from ``timeout``, Ctrl-C) or fails must not leave a host,
its zygote, a publisher or a private database server running. ``stop_on_signals`` turns SIGTERM
and SIGINT into ``SystemExit`` so that every ``finally`` and ``with`` below ``main`` runs; each
child started through ``child_group`` leads its own process group, which is stopped whole
(SIGTERM, then SIGKILL after a grace) when the block ends, however it ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


class PhaseFailed(SystemExit):
    """A phase did not complete within its bound: exit 1 with one line saying which."""

    def __init__(self, message: str) -> None:
        print(f"benchmark failed: {message}", file=sys.stderr, flush=True)
        super().__init__(1)


#: A stop that arrived while a child was being started (raised once it is known).
_deferred: list[int] = []
_launching = 0


def _stop(signum: int, frame: object) -> None:
    if _launching:
        _deferred.append(signum)
        return
    raise SystemExit(128 + signum)


def stop_on_signals() -> None:
    """SIGTERM and SIGINT end the benchmark through its cleanup, not around it."""
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def stop_group(proc: subprocess.Popen[Any], grace: float = 20.0) -> None:
    """SIGTERM ``proc``'s process group, SIGKILL it after ``grace``; reap ``proc``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
    # Whatever is left of the group (a zygote, Workers) goes too.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


#: Environment variable marking every process a ``child_group`` started, and their children.
GROUP_TAG = "APSUP_BENCH_GROUP"


def tagged(tag: str, variable: str = GROUP_TAG) -> list[int]:
    """Live processes whose environment carries ``variable=tag`` (zombies do not count)."""
    needle = f"{variable}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes():
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(int(entry.name))
    return found


def kill_tagged(tag: str, within: float = 5.0) -> None:
    """SIGKILL what is left of a group that escaped it: Workers lead process groups of their
    own (``setsid``), so a host killed mid-drain leaves them running, reparented."""
    deadline = time.monotonic() + within
    while (left := tagged(tag)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


@contextlib.contextmanager
def child_group(
    args: Sequence[str], grace: float = 20.0, **kwargs: Any
) -> Iterator[subprocess.Popen[Any]]:
    """``Popen(args)`` as the leader of a new process group, stopped whole on exit, with every
    descendant (tagged through the environment they inherit)."""
    tag = uuid.uuid4().hex
    kwargs["env"] = {**(kwargs.get("env") or os.environ), GROUP_TAG: tag}
    # A SIGTERM that lands while Popen runs would raise after the fork but before ``proc`` is
    # known, and the child would never be stopped: the handler defers it until the try below.
    # (Blocking the signals instead would leave them blocked in the child too.)
    global _launching
    _launching += 1
    try:
        proc = subprocess.Popen(list(args), start_new_session=True, **kwargs)
    finally:
        _launching -= 1
    try:
        if _deferred:
            raise SystemExit(128 + _deferred[0])
        yield proc
    finally:
        stop_group(proc, grace)
        kill_tagged(tag)
