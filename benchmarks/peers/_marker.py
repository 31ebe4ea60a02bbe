"""Completion marks shared by every peer's no-op task: one appended line per task.

``<task id> <enqueue time> <done time>`` (``time.time()``, comparable across processes) goes to
the file named by ``$PEERS_MARKERS`` with one ``O_APPEND`` write, no fsync: the cheapest
observable "this task ran" that every system can afford alike (about 20 µs)."""

from __future__ import annotations

import os
import time


def mark(task_id: int, enqueued: float) -> None:
    line = f"{task_id} {enqueued:.6f} {time.time():.6f}\n".encode()
    fd = os.open(os.environ["PEERS_MARKERS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_marks(path: str) -> list[tuple[int, float, float]]:
    """Every complete line of ``path`` (a line still being written is left for the next read)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return []
    out = []
    for line in data.split(b"\n")[:-1]:
        i, enq, done = line.split()
        out.append((int(i), float(enq), float(done)))
    return out
