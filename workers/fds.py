"""Waiting on file descriptors: one ``poll(2)``, no selector objects.

``multiprocess.connection.wait`` (the host's wait before this) builds a ``selectors`` selector
and a key object per fd on every call; the host waits several times per invocation over
every Worker's sentinel, and that was a tenth of its CPU per invocation at 8 Workers.
"""

from __future__ import annotations

import math
import select
from collections.abc import Iterable


def readable(fds: Iterable[int], timeout: float | None) -> list[int]:
    """The fds of ``fds`` that are readable, at end of file or in error within ``timeout``
    seconds (``None``: no limit; 0: a check that does not block)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
    return [fd for fd, _ in poller.poll(ms)]
