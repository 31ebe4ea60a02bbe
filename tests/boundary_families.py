"""A test family for the capacity gate: one Worker, a 1 s interval, and a processor that holds
its Worker until the test creates the file named by ``BOUNDARY_RELEASE`` (inherited by the
Worker from the host's environment)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from apsup.context import ExecutionContext
from apsup.registry import Registry, family

registry = Registry()
HOLD_LIMIT_S = 60.0


@family("busy-one", interval=1, max_workers=1, timeout=120, registry=registry)
def busy_one(scope_id: str, ctx: ExecutionContext) -> None:
    if scope_id == "hold":
        release = Path(os.environ["BOUNDARY_RELEASE"])
        deadline = time.monotonic() + HOLD_LIMIT_S
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    with ctx.fenced() as conn:
        ctx.mark_clean(conn, ctx.dirty_generation(conn))
        ctx.acknowledge(conn)
