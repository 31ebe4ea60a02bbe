"""Only the Worker wrapper can ask its host to acknowledge: no exit status a processor can
produce passes for it (both backends, a real host, real Workers).

A processor that calls ``sys.exit(N)`` or ``os._exit(N)`` with N the code the wrapper uses to
ask for an acknowledgment (9), a progress conflict (3), a stale term (4) or storage trouble
(6-8) fails like any other abnormal exit: nothing is acknowledged, one failure is counted and
the Scope backs off. The wrapper's own codes keep their meaning because it vouches for them on
the launch's hold pipe, which the processor is never given.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apsup.scheduling import Outcome
from apsup.store import migrate, open_backend
from apsup.supervisor.exits import ExitFacts, classify
from apsup.workers.exit_codes import ExitCode
from tests import liveness_families as lf
from tests.liveness_support import ExitRecorder, cycle_until, handled, live_host, request

pytestmark = [pytest.mark.timeout(120), pytest.mark.backends("sqlite", "mysql", "postgresql")]

FORGED = ["sysexit.9", "osexit.9", "sysexit.3", "osexit.4", "sysexit.6", "osexit.8"]


def test_a_processor_exit_status_never_acknowledges(db_url: str, tmp_path: Path) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work
    recorder = ExitRecorder()
    try:
        generations = {scope: request(backend, fam, scope) for scope in FORGED}
        real = request(backend, fam, "noack.real")
        with live_host(db_url, [fam], tmp_path, hooks=recorder) as b:
            sup = b.host.supervisors[0]
            cycle_until(
                b.host,
                lambda: len(recorder.causes) >= len(FORGED) + 1,
                60,
                "every first exit classified",
            )
            first = recorder.causes[: len(FORGED) + 1]
            assert sorted(cause or "success" for _, cause in first) == sorted(
                ["failure"] * len(FORGED) + ["success"]
            ), first
            assert sup.failed[fam.name] >= len(FORGED)
            assert sup.completed[fam.name] == 1
            assert sup.core is not None
            for scope in FORGED:
                info = sup.core.key_info(fam.name, scope)
                assert info is not None and info.consecutive_failures >= 1, scope
        for scope, g in generations.items():
            assert not handled(backend, fam, scope, g), f"{scope} forged its acknowledgment"
        assert handled(backend, fam, "noack.real", real)  # the wrapper's own request still works
    finally:
        backend.dispose()


def test_the_wrapper_vouched_codes_keep_their_meaning() -> None:
    def outcome(code: int, vouched: bool, **kw: bool) -> tuple[Outcome, str | None]:
        return classify(
            ExitFacts(
                code,
                vouched,
                kw.get("timed_out", False),
                kw.get("handled", False),
                kw.get("term_valid", False),
            )
        )

    # The durable acknowledgment decides success, whoever set the status.
    assert outcome(0, False, handled=True) == (Outcome.SUCCESS, None)
    assert outcome(0, True, handled=True) == (Outcome.SUCCESS, None)
    assert outcome(ExitCode.STATUS_LOST, False, handled=True) == (Outcome.SUCCESS, None)
    assert outcome(ExitCode.TERMINATED, True, timed_out=True, handled=True) == (
        Outcome.SUCCESS,
        None,
    )
    assert outcome(0, True) == (Outcome.FAILURE, "no_ack")
    assert outcome(0, False) == (Outcome.FAILURE, "no_ack")
    assert outcome(ExitCode.TERMINATED, True, timed_out=True) == (Outcome.TIMEOUT, "timeout")
    assert outcome(-9, False) == (Outcome.FAILURE, "crash")
    # Vouched: the wrapper's meaning.
    assert outcome(ExitCode.PROGRESS_CONFLICT, True) == (Outcome.CONFLICT, "conflict")
    assert outcome(ExitCode.STALE_TERM, True, term_valid=True) == (Outcome.CONFLICT, "stale_term")
    assert outcome(ExitCode.STALE_TERM, True) == (Outcome.FAILURE, "stale_term")
    for code in (ExitCode.STORAGE_FULL, ExitCode.STORAGE_READ_ONLY, ExitCode.STORAGE_IO):
        assert outcome(code, True) == (Outcome.CONFLICT, "storage")
    assert outcome(ExitCode.PROCESSOR_FAILURE, True) == (Outcome.FAILURE, "failure")
    # Not vouched: the processor's own status means only "failed", whatever the number.
    for code in (3, 4, 6, 7, 8, 9, 1, 2, 5, 127, 143):
        assert outcome(code, False) == (Outcome.FAILURE, "failure"), code
        assert outcome(code, False, term_valid=True) == (Outcome.FAILURE, "failure"), code
