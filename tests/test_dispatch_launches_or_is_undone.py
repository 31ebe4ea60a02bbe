"""A dispatch either launches a Worker or is undone completely, whatever raises in between; a
transient error costs only the step it hit (both backends, a real host, real Workers).

An exception from a hook that runs during the dispatch (tracing, the log relay) or from the
dispatch's read leaves no key RUNNING without a Worker and holds no capacity: the key goes back
to the head of its ready queue, the family is shown degraded with the error while it waits,
and the step is tried again about one poll later (longer only while errors repeat, and never
longer than a renewal interval on an elected backend).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from apsup.scheduling import KeyState
from apsup.store import migrate, open_backend
from apsup.supervisor.supervisor import Hooks
from tests import liveness_families as lf
from tests.liveness_support import (
    INTENTS,
    cycle_until,
    handled,
    live_host,
    readiness,
    rename_table,
    request,
)

pytestmark = pytest.mark.timeout(120)


class FailingHook(Hooks):
    """``invocation_started`` or ``launch_streams`` raises for the first ``times`` calls."""

    def __init__(self, where: str, times: int) -> None:
        self.where, self.left, self.raised = where, times, 0

    def _maybe_raise(self) -> None:
        if self.left > 0:
            self.left -= 1
            self.raised += 1
            raise RuntimeError(f"{self.where} hook broke")

    def invocation_started(self, worker_id: str, fields: dict[str, Any]) -> dict[str, str]:
        if self.where == "started":
            self._maybe_raise()
        return {}

    def launch_streams(self, worker_id: str, fields: dict[str, Any]) -> tuple[int, ...]:
        if self.where == "streams":
            self._maybe_raise()
        return ()


@pytest.mark.parametrize("where", ["started", "streams"])
def test_a_hook_error_during_dispatch_undoes_the_dispatch(
    db_url: str, tmp_path: Path, where: str
) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work
    hook = FailingHook(where, times=2)
    try:
        g = request(backend, fam, "ok.hooked")
        with live_host(db_url, [fam], tmp_path, hooks=hook) as b:
            sup = b.host.supervisors[0]
            cycle_until(b.host, lambda: hook.raised >= 1, 30, "the hook raised")
            assert sup.core is not None
            # Undone: nothing runs, nothing is counted against the budget, the key is queued.
            assert sup.core.key_state(fam.name, "ok.hooked") is KeyState.READY
            assert sup.core.running_count(fam.name) == 0
            assert not sup.running and len(b.pool) == 0
            assert fam.name in sup.degraded and "hook broke" in sup.degraded[fam.name]
            cycle_until(b.host, lambda: sup.completed[fam.name] == 1, 30, "the Scope ran")
            assert hook.raised == 2 and sup.failed[fam.name] == 0
            assert handled(backend, fam, "ok.hooked", g)
            assert sup.core.running_count(fam.name) == 0 and not sup.running
    finally:
        backend.dispose()


def test_a_failed_dispatch_read_costs_about_one_poll_and_shows_degraded(
    db_url: str, tmp_path: Path
) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work
    try:
        busy = [f"noackwait.{i}" for i in range(fam.max_workers)]
        for scope in busy:
            request(backend, fam, scope)
        g = request(backend, fam, "ok.blip")
        with live_host(db_url, [fam], tmp_path) as b:
            sup = b.host.supervisors[0]
            # Every slot busy: the request is found and queued, not dispatched.
            cycle_until(
                b.host,
                lambda: (
                    sup.core is not None
                    and sup.core.key_state(fam.name, "ok.blip") is KeyState.READY
                    and all((tmp_path / f"started.{s}").exists() for s in busy)
                ),
                30,
                "the request queued behind busy Workers",
            )
            # The table vanishes; a Worker exits and frees its slot: the dispatch read fails.
            rename_table(db_url, INTENTS, INTENTS + "_away")
            (tmp_path / f"go.{busy[0]}").touch()
            try:
                cycle_until(b.host, lambda: fam.name in sup.degraded, 30, "the failed step")
                assert sup.core is not None
                snap = sup.core.snapshot(sup.now())[fam.name]
                assert snap.degraded and snap.postponed_until is not None
                # About one poll, not the 30 s a failed step used to cost.
                assert (snap.postponed_until - sup.now()).total_seconds() <= 0.5
                ready = readiness(b.host)
                shown = ready["families"][fam.name]
                assert shown["status"] != "ok", shown
            finally:
                rename_table(db_url, INTENTS + "_away", INTENTS)
            cycle_until(b.host, lambda: handled(backend, fam, "ok.blip", g), 30, "the Scope ran")
            for scope in busy[1:]:
                (tmp_path / f"go.{scope}").touch()
            cycle_until(b.host, lambda: sup.completed[fam.name] == 5, 30, "every Scope ran")
            assert fam.name not in sup.degraded and sup.failed[fam.name] == 0
    finally:
        backend.dispose()
