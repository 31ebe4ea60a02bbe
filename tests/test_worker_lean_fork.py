"""The zygote forks Workers with libc's ``fork()`` when that changes nothing a Worker relies on
(``apsup.workers.fork``), and with ``os.fork()`` otherwise.

In the image ``build_host`` prepares, every Worker is forked lean and still behaves as a fresh
Python process: ``random`` is reseeded per Worker, threads start and join. A preloaded module
that registers its own ``os.register_at_fork`` hook gets it run in every Worker (the zygote
falls back to ``os.fork()``), and so does a zygote that has a second thread.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from multiprocess.connection import wait

from apsup.store import worker_preload
from apsup.supervisor.launcher import WARM_MODULE, _start_pool
from apsup.workers import ExitCode
from apsup.workers.invoke import TARGET

pytestmark = pytest.mark.backends("sqlite")

TARGETS = "tests.worker_targets"

HOOK_MODULE = """
import os
ran_in_child = False


def _after_in_child():
    global ran_in_child
    ran_in_child = True


os.register_at_fork(after_in_child=_after_in_child)
"""

THREAD_MODULE = """
import threading
import time

ran_in_child = "thread"
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
"""


def _launch_reports(
    db_url: str, extra: list[str], report: Path, count: int, notes: list[str | None] | None = None
) -> list[list[str]]:
    modules = [TARGET.split(":", 1)[0], TARGETS, *extra, *worker_preload(db_url), WARM_MODULE]
    pool = _start_pool(modules, db_url, grace_seconds=5.0)
    if notes is not None:
        notes.append(pool.fork_note)
    payload = orjson.dumps({"path": str(report)})
    try:
        for i in range(count):
            pool.launch(f"w{i}", f"{TARGETS}:report_fork", payload, 60)
        while len(pool):
            wait(pool.sentinels(), 5.0)
            for ex in pool.poll():
                assert ex.exitcode == ExitCode.SUCCESS, ex.reason
    finally:
        pool.close()
    return [line.split() for line in report.read_text().splitlines()]


def test_workers_of_the_prepared_image_are_forked_lean_and_work(
    db_url: str, tmp_path: Path
) -> None:
    notes: list[str | None] = []
    rows = _launch_reports(db_url, [], tmp_path / "fork.txt", 4, notes)
    assert notes == [None], "the pool reports a reason where there is none"
    assert len(rows) == 4
    assert {row[0] for row in rows} == {"True"}, "the zygote did not use the lean fork"
    assert len({row[1] for row in rows}) == 4, "Workers share one random state"
    assert {row[2] for row in rows} == {"1"}, "a Worker could not run a thread"
    assert len({row[4] for row in rows}) == 4


@pytest.mark.parametrize("source", [HOOK_MODULE, THREAD_MODULE], ids=["at-fork-hook", "thread"])
def test_a_preload_that_needs_os_fork_gets_it(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    (tmp_path / "apsup_test_fork_probe.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    notes: list[str | None] = []
    rows = _launch_reports(db_url, ["apsup_test_fork_probe"], tmp_path / "fork.txt", 3, notes)
    # The operator is told why (``build_host`` logs it): the module by name, or the threads.
    want = "apsup_test_fork_probe registered" if source is HOOK_MODULE else "runs 2 threads"
    assert notes[0] is not None and want in notes[0], notes
    assert len(rows) == 3
    assert {row[0] for row in rows} == {"False"}, "the zygote forked lean anyway"
    expected = "True" if source is HOOK_MODULE else "thread"
    assert {row[3] for row in rows} == {expected}, "the module's at-fork hook did not run"
    assert len({row[1] for row in rows}) == 3


HOOKED_FAMILY = """
import os

from apsup.registry import Registry, family

registry = Registry()
os.register_at_fork(after_in_child=lambda: None)


@family("hooked", max_workers=1, timeout=30, registry=registry)
def hooked(scope_id, ctx):
    return None
"""


def test_the_host_says_why_its_workers_do_not_fork_lean(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import importlib
    import sys

    from apsup.store import migrate
    from apsup.supervisor.launcher import build_host
    from tests.replicas import families

    migrate(db_url)
    (tmp_path / "apsup_test_hooked_family.py").write_text(HOOKED_FAMILY)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    hooked = importlib.import_module("apsup_test_hooked_family").hooked
    try:
        for fams, warned in ((list(families.registry), False), ([hooked], True)):
            caplog.clear()
            with caplog.at_level("WARNING", logger="apsup.launcher"):
                build_host(db_url, fams, shutdown_grace=2.0).close()
            said = [r for r in caplog.records if "lean fork" in r.getMessage()]
            assert len(said) == int(warned), [r.getMessage() for r in caplog.records]
            if warned:
                assert "apsup_test_hooked_family" in said[0].reason  # type: ignore[attr-defined]
                assert "authoring-families" in said[0].fix  # type: ignore[attr-defined]
    finally:
        sys.modules.pop("apsup_test_hooked_family", None)
