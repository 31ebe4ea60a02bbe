"""``python -m tests.fork_fault_host``: the host ``apsup run --app tests.fork_fault_app`` would
be, but with a failure backoff of 0.3 s instead of the RFC's 30 s, so that a retry lands while a
lost Worker still runs (``tests/faults/test_launch_faults.py``)."""

from __future__ import annotations

import tests.fork_fault_app  # noqa: F401  (registers the family under its importable name)
from apsup.config import Settings
from apsup.registry import default_registry
from apsup.scheduling import Backoff
from apsup.supervisor.runtime import Runtime


def main() -> int:
    settings = Settings.load(default_registry)
    backoff = Backoff(base=0.3, factor=2.0, cap=1.0, jitter=0.0)
    Runtime(settings, default_registry, backoff=backoff, configure_logs=True).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
