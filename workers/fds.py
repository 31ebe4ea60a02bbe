"""Waiting on file descriptors (one ``poll(2)``, no selector objects), and the 8-byte integers
the launch pipes carry (a Worker's pid, its exit status).

``multiprocess.connection.wait`` (the host's wait before this) builds a ``selectors`` selector
and a key object per fd on every call; the host waits several times per invocation over
every Worker's sentinel, and that was a tenth of its CPU per invocation at 8 Workers.
"""

from __future__ import annotations

import math
import os
import select
import struct
from collections.abc import Iterable


def readable(fds: Iterable[int], timeout: float | None) -> list[int]:
    """The fds of ``fds`` that are readable, at end of file or in error within ``timeout``
    seconds (``None``: no limit; 0: a check that does not block)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
    return [fd for fd, _ in poller.poll(ms)]


_SIGNED = struct.Struct("q")


def write_signed(fd: int, n: int) -> None:
    data = _SIGNED.pack(n)
    while data:
        written = os.write(fd, data)
        data = data[written:]


#: A Worker wrapper's verdict on its hold pipe is ``VERDICT_BASE - exit code``: negative, so it
#: is never mistaken for the pid that precedes it there.
VERDICT_BASE = -(1 << 32)


def write_verdict(fd: int, code: int) -> None:
    """The wrapper's word for the exit code it is about to exit with (see ``read_verdict``)."""
    write_signed(fd, VERDICT_BASE - code)


def read_verdict(fd: int) -> int | None:
    """The exit code the Worker's wrapper vouched for on its hold pipe, or None.

    Reads what is there without blocking (the Worker has exited: its records are complete;
    a grandchild may still hold the write end, so end of file need not have come)."""
    verdict = None
    while readable([fd], 0):
        try:
            n = read_signed(fd)
        except (OSError, EOFError):
            break
        if n <= VERDICT_BASE:
            verdict = VERDICT_BASE - n
    return verdict


def read_signed(fd: int) -> int:
    """The next 8-byte integer from ``fd``; ``EOFError`` at end of file."""
    data = b""
    while len(data) < _SIGNED.size:
        chunk = os.read(fd, _SIGNED.size - len(data))
        if not chunk:
            raise EOFError("end of file before an integer")
        data += chunk
    return int(_SIGNED.unpack(data)[0])
