"""Families for tests/test_worker_visibility.py (module level: Workers import them)."""

from __future__ import annotations

import logging
import os
import sys
import time

from apsup.context import ExecutionContext
from apsup.registry import Registry, family

registry = Registry()
log = logging.getLogger("tests.visibility")

SECRET_TEXT = "source-body-that-must-not-leak"


@family(
    "vis-fail",
    interval=3600,
    max_workers=2,
    timeout=60,
    registry=registry,
    log_exception_messages=False,  # its messages quote Source text: the type only
)
def vis_fail(scope_id: str, ctx: ExecutionContext) -> None:
    log.info("processing %s", scope_id)
    log.debug("debug detail that the INFO host drops")
    print("plain print line")
    sys.stderr.write("stray stderr line\n")
    os.write(2, b"raw fd 2 line\n")
    raise RuntimeError(SECRET_TEXT)


@family(
    "vis-optin",
    interval=3600,
    max_workers=1,
    timeout=60,
    registry=registry,
    log_exception_messages=True,
)
def vis_optin(scope_id: str, ctx: ExecutionContext) -> None:
    raise RuntimeError("an opted-in message")


@family("vis-hang", interval=3600, max_workers=1, timeout=300, registry=registry)
def vis_hang(scope_id: str, ctx: ExecutionContext) -> None:
    time.sleep(300)


@family("vis-chatty", interval=3600, max_workers=1, timeout=60, registry=registry)
def vis_chatty(scope_id: str, ctx: ExecutionContext) -> None:
    for i in range(20000):
        log.warning("chatty line %d %s", i, "x" * 50000 if i == 0 else "")
    with ctx.fenced() as conn:
        ctx.acknowledge(conn)


@family("vis-manual", max_workers=1, timeout=60, registry=registry)
def vis_manual(scope_id: str, ctx: ExecutionContext) -> None:
    with ctx.fenced() as conn:
        ctx.acknowledge(conn)


@family("vis-slow", interval=3600, max_workers=1, timeout=60, registry=registry)
def vis_slow(scope_id: str, ctx: ExecutionContext) -> None:
    time.sleep(3)
    with ctx.fenced() as conn:
        ctx.acknowledge(conn)


@family("vis-traced", interval=3600, max_workers=1, timeout=60, registry=registry)
def vis_traced(scope_id: str, ctx: ExecutionContext) -> None:
    from opentelemetry import trace

    with trace.get_tracer("tests.visibility").start_as_current_span("inner"):
        log.info("inside the processor's span")
    with ctx.fenced() as conn:
        ctx.acknowledge(conn)
