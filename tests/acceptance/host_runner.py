"""Run one real host in its own process, for tests that SIGKILL or SIGTERM it.

``python -m tests.acceptance.host_runner '<json>'`` with::

    {"db": URL, "families": {"acc-a": {"interval": 1, "max_workers": 2, "timeout": 30}},
     "worker_settings": {...}, "backoff": [base, cap], "page_size": N,
     "kill_after_admissions": N, "kill_after_scan_start": false,
     "shutdown_grace": 3.0, "grace_seconds": 1.0}

It prints ``READY <pid>`` once every term is established, then runs the host loop until SIGTERM
/SIGINT (graceful shutdown, exit 0). Exit 3 with the error on stderr when another host already
runs on the SQLite database, as ``apsup run`` does.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from apsup.errors import HostConflictError
from apsup.supervisor.launcher import build_host
from tests.acceptance import families as fams
from tests.acceptance.harness import (
    FAST_BACKOFF,
    lease_policy,
    make_backoff,
    patched_scheduler,
    scheduler_class,
)

EXIT_HOST_CONFLICT = 3


def main(argv: list[str]) -> int:
    config = json.loads(argv[0])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    cls = scheduler_class(
        page_size=config.get("page_size"),
        kill_after_admissions=config.get("kill_after_admissions"),
        kill_after_scan_start=bool(config.get("kill_after_scan_start", False)),
    )
    with patched_scheduler(cls):
        try:
            bundle = build_host(
                config["db"],
                fams.from_spec(config["families"]),
                worker_settings=config.get("worker_settings"),
                shutdown_grace=float(config.get("shutdown_grace", 3.0)),
                grace_seconds=float(config.get("grace_seconds", 1.0)),
                lease=lease_policy(),
                backoff=make_backoff(tuple(config.get("backoff", FAST_BACKOFF))),
            )
        except HostConflictError as exc:
            print(f"apsup: {exc}", file=sys.stderr, flush=True)
            return EXIT_HOST_CONFLICT
        host = bundle.host
        try:
            host.install_signal_handlers()
            host.start()
            print(f"READY {os.getpid()}", flush=True)
            while not host.stopping.is_set():
                host.cycle()
        finally:
            host.shutdown()
            bundle.close()
    print("STOPPED", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
