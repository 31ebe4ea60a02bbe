"""Seeded simulation of the real scheduling core (see harness.py for what a seed exercises).

* ``test_seeds``: 2,000 seeds by default, in batches so that a failure names its seed.
* ``test_replay``: ``APSUP_SIM_SEED=N .venv/bin/pytest tests/simulation -k replay`` reruns one
  seed with the full trace printed (``APSUP_SIM_STEPS`` overrides the step count).
* ``test_soak`` (marker ``soak``): 50 seeds with 4x longer fault phases by default, 20,000
  such seeds (in batches, xdist-friendly) when ``APSUP_SOAK=1``.
* ``test_simulation_catches_mutant``: each mutant breaks one rule in a copy of the core; the
  simulation must catch it, which proves that the invariants are not vacuous.
"""

from __future__ import annotations

import os
import re
import sys
import types
from pathlib import Path

import pytest

import apsup.scheduling.core as core
from apsup.scheduling import Scheduler

from .harness import REPLAY, SimulationFailure, run_seed

SEEDS = 2_000
BATCH = 100
STEPS = 150


def _env(name: str) -> str | None:
    """Read a variable even though tests/conftest.py scrubs ``APSUP_*`` at import.

    The scrub protects apsup settings; the replay seed is a test input, so fall back to the
    environment the process started with.
    """
    if name in os.environ:
        return os.environ[name]
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for entry in raw.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode()
    return None


def _run(seeds: range, steps: int) -> None:
    failures: list[SimulationFailure] = []
    for seed in seeds:
        try:
            run_seed(seed, steps)
        except SimulationFailure as exc:
            failures.append(exc)
    if failures:
        replays = "\n".join(REPLAY.format(seed=f.seed) for f in failures)
        pytest.fail(f"{len(failures)} seed(s) failed; replay with:\n{replays}\n\n{failures[0]}")


@pytest.mark.parametrize("batch", range(SEEDS // BATCH), ids=lambda b: f"seeds{b * BATCH}")
def test_seeds(batch: int) -> None:
    _run(range(batch * BATCH, (batch + 1) * BATCH), STEPS)


def test_replay() -> None:
    seed = _env("APSUP_SIM_SEED")
    if seed is None:
        pytest.skip("set APSUP_SIM_SEED=<seed> to replay one simulation with its trace")
    steps = int(_env("APSUP_SIM_STEPS") or (SOAK_STEPS if int(seed) >= 1_000_000 else STEPS))
    sim = run_seed(int(seed), steps, trace_all=True)
    print(f"seed {seed}: ok, {sim.counters}")


SOAK_FULL = _env("APSUP_SOAK") == "1"
SOAK_BATCH = 200 if SOAK_FULL else 50  # small batches stay far below the per-test timeout
SOAK_BATCHES = 100 if SOAK_FULL else 1
SOAK_STEPS = 600


@pytest.mark.soak
@pytest.mark.parametrize("batch", range(SOAK_BATCHES), ids=lambda b: f"soak{b}")
def test_soak(batch: int) -> None:
    """Longer fault phases on other seeds: 50 seeds by default, 20,000 with APSUP_SOAK=1."""
    start = 1_000_000 + batch * SOAK_BATCH
    _run(range(start, start + SOAK_BATCH), SOAK_STEPS)


# --- the simulation must be able to fail ------------------------------------------------------

MUTANTS: dict[str, tuple[list[tuple[str, str]], str]] = {
    # name: ([(original, replacement)], regex the failure reason must match)
    "second dispatch for a running key": (
        [
            (
                "            if row.scope_id not in f.keys and row.scope_id not in f.parked:\n",
                "            if True:\n",
            ),
            (
                "        if scope_id in f.keys:\n            return",
                "        if False:\n            return",
            ),
        ],
        r"second Worker|Workers are live|but the core has it",
    ),
    "budget not enforced": (
        [
            (
                "if f.ready and f.running < f.budget and not f.paused:",
                "if f.ready and f.running <= f.budget and not f.paused:",
            )
        ],
        r"budget|Workers are live",
    ),
    "no backoff": (
        [
            (
                "delay = timedelta(seconds=self._backoff.delay(key.failures, self._rng))",
                "delay = timedelta(0)",
            )
        ],
        r"backoff",
    ),
    "conflict counted as failure": (
        [
            (
                'self._wait(f, scope_id, key, "conflict", now + self._conflict_delay)',
                'key.failures += 1\n            self._wait(f, scope_id, key, "conflict", now)',
            )
        ],
        r"backoff",
    ),
    "notifications during a pass forgotten": (
        [("if f.notifications != current.started_at:", "if False:")],
        r"stranded|did not converge",
    ),
    "restore without request recovery": (
        [
            (
                "        f.request_pass = _RequestPass(full=True)",
                "        f.request_pass = None",
            )
        ],
        r"stranded|did not converge",
    ),
    "scan marker ignored": (
        [
            (
                "row.last_auto_scan_generation >= scan.generation",
                "row.last_auto_scan_generation > scan.generation",
            )
        ],
        r"admitted twice",
    ),
    "discovery without capacity": (
        [
            (
                "            if not f.has_room() or f.scan_held_back(now):\n"
                "                return None\n",
                "",
            ),
            ("min(f.spec.page_size, wanted)", "f.spec.page_size"),  # the page's own clamp
            ("not f.request_pass.paused or 2 * len(f.ready) <= f.limit", "True"),  # refill gate
        ],
        r"capacity|without going idle",
    ),
    "failed key dropped from memory": (
        [
            (
                "            key.failures = max(key.failures, prior_failures) + 1\n"
                "            delay",
                "            del f.keys[scope_id]\n            return\n            delay",
            )
        ],
        r"backoff|stranded|did not converge",
    ),
    "exited key freed before its outcome": (
        [("        key.state = KeyState.EXITED\n", "        del f.keys[scope_id]\n")],
        r"backoff|stranded|did not converge|second Worker|but the core has it",
    ),
    "exited Worker's capacity released twice": (
        [
            (
                "        if key.state is KeyState.RUNNING:\n            self._release(f, scope_id)",
                "        if True:\n            self._release(f, scope_id)",
            )
        ],
        r"running|budget",
    ),
}


def mutant(name: str) -> type[Scheduler]:
    """A copy of the core with one rule broken (the original module is untouched)."""
    source = Path(core.__file__).read_text()
    for original, replacement in MUTANTS[name][0]:
        assert source.count(original) == 1, f"mutant {name!r} no longer applies: {original!r}"
        source = source.replace(original, replacement)
    module = types.ModuleType(f"apsup.scheduling._mutant_{abs(hash(name))}")
    sys.modules[module.__name__] = module
    try:
        exec(compile(source, f"<mutant {name}>", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    # share the enums with the harness so identity comparisons keep working
    module.__dict__.update(KeyState=core.KeyState, Outcome=core.Outcome)
    cls: type[Scheduler] = module.Scheduler
    return cls


@pytest.mark.parametrize("name", list(MUTANTS))
def test_simulation_catches_mutant(name: str) -> None:
    factory = mutant(name)
    pattern = re.compile(MUTANTS[name][1])
    for seed in range(600):
        try:
            run_seed(seed, STEPS, scheduler_factory=factory, verify_core=False)
        except SimulationFailure as exc:
            assert pattern.search(exc.reason), f"seed {seed} failed differently: {exc}"
            return
    pytest.fail(f"mutant {name!r} survived 600 seeds")
