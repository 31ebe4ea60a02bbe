"""``--app`` module for the web console's browser test: one family that sleeps (a running
Worker to show) and one that always fails (failing Scopes and their errors to show)."""

from __future__ import annotations

import time

from apsup.context import ExecutionContext
from apsup.registry import default_registry, family

if "console-sleep" not in default_registry:

    @family("console-sleep", max_workers=2, timeout=120, registry=default_registry)
    def console_sleep(scope_id: str, ctx: ExecutionContext) -> None:
        time.sleep(60)

    @family("console-fail", max_workers=2, timeout=60, registry=default_registry)
    def console_fail(scope_id: str, ctx: ExecutionContext) -> None:
        raise ValueError(f"console-boom for {scope_id} (mysql://svc:pw-4421@db/app)")
