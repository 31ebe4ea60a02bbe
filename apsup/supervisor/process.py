"""Process-level plumbing shared by every apsup entry point that owns its process (``apsup run``
and each dedicated family child): signal handling and log setup. Nothing here knows about
leases, terms or Supervisors."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from apsup.observability.logging import configure_logging


def main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def signals(handler: Callable[[], None]) -> Iterator[None]:
    """SIGTERM/SIGINT call ``handler`` while inside; previous handlers restored after.

    Outside the main thread (an embedding application, tests) nothing is installed: the caller
    stops the Runtime with ``Runtime.stop()``.
    """
    if not main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def on_signal(signum: int, frame: Any) -> None:
        handler()

    for s in previous:
        signal.signal(s, on_signal)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def configure_logs(fmt: str, level: str) -> None:
    """Install apsup's redacting handler; drop a plain stderr handler (``basicConfig``) so that
    lines are not printed twice."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if type(h) is logging.StreamHandler and getattr(h, "stream", None) in (
            sys.stderr,
            sys.stdout,
        ):
            root.removeHandler(h)
    configure_logging(fmt, level)  # type: ignore[arg-type]
