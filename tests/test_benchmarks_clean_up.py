"""A benchmark never hangs silently and never leaves anything running.

``benchmarks/wakeup.py`` prints its progress per phase, fails with one line when a phase cannot
finish within its bound, and, stopped by SIGTERM in the middle of a phase, stops every process it
started (the ``apsup run`` host, its zygote, the publisher) before it exits. Every process it
starts carries the environment it was given, so a tag in that environment finds any survivor.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parent.parent
WAKEUP = REPO / "benchmarks" / "wakeup.py"


def _load_processes() -> Any:
    """``benchmarks/_processes.py`` under a name of its own (the benchmarks folder is not put
    on the path: its ``mysql`` and ``intake`` would shadow other modules)."""
    spec = importlib.util.spec_from_file_location(
        "apsup_bench_processes", REPO / "benchmarks" / "_processes.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_PROCESSES = _load_processes()


def _tagged(tag: str) -> list[int]:
    """Live processes whose environment carries the test's tag (the benchmarks' own finder)."""
    return list(_PROCESSES.tagged(tag, "APSUP_BENCH_TEST_TAG"))


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"


def _start(tag: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, APSUP_BENCH_TEST_TAG=tag, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, str(WAKEUP), "--out", "-", *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a survivor is not killed with the test's own group
    )


def test_sigterm_in_the_middle_leaves_nothing_running() -> None:
    tag = uuid.uuid4().hex
    bench = _start(tag, "--samples", "200", "--mysql", "unused://")
    try:
        assert bench.stderr is not None
        lines = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = bench.stderr.readline()
            lines.append(line)
            if "publishing" in line or not line:
                break
        assert any("publishing" in line for line in lines), lines
        assert len(_tagged(tag)) >= 3, "the host, its zygote and the publisher run"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while _tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {pid: _cmdline(pid) for pid in _tagged(tag)}
        assert left == {}, "processes the benchmark started outlived it"
    finally:
        for pid in _tagged(tag):
            os.kill(pid, signal.SIGKILL)
        if bench.poll() is None:
            bench.kill()
        bench.communicate()


def test_a_phase_that_cannot_finish_fails_with_one_line() -> None:
    tag = uuid.uuid4().hex
    bench = _start(tag, "--samples", "2", "--ready-bound", "0.05", "--mysql", "unused://")
    out, err = bench.communicate(timeout=120)
    assert bench.returncode == 1, (out, err)
    failures = [line for line in err.splitlines() if line.startswith("benchmark failed:")]
    assert failures == ["benchmark failed: sqlite warm-up request not committed in time"] or (
        len(failures) == 1 and "sqlite host ready: not done within 0.05 s" in failures[0]
    ), err
    assert "Traceback" not in err
    assert _tagged(tag) == []
