"""Real SQLite faults at chosen moments: another process holding the write lock (SQLITE_BUSY for
everyone else), and a size-limited tmpfs filled to the last byte (SQLITE_FULL)."""

from __future__ import annotations

import contextlib
import errno
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

_HOLD_LOCK = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=60)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("ROLLBACK")
"""


@contextlib.contextmanager
def write_lock_held(db_path: Path | str, seconds: float) -> Iterator[subprocess.Popen[str]]:
    """Another process holds the database write lock (``BEGIN IMMEDIATE``) for ``seconds``,
    or until the block ends; yields once the lock is held."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(db_path), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "locked", "the lock holder did not start"
        yield holder
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str = "6m") -> Iterator[Path | None]:
    """A size-limited tmpfs mounted at ``where`` (needs root); yields None where this process
    may not mount, so the caller can skip saying why."""
    where.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        yield None
        return
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(volume: Path) -> Path:
    """Write a filler file until the volume refuses with ENOSPC; delete it to free the space."""
    filler = volume / "filler"
    chunk = b"\0" * 4096
    with open(filler, "wb", buffering=0) as fh:
        while True:
            try:
                fh.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                return filler
