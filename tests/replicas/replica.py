"""One apsup replica as a real process for the multi-replica tests (see deploy/local-cluster.sh).

    python -m tests.replicas.replica --info FILE [--requests N --interval S --scopes K]

Configuration comes from the environment exactly as in production
(``POWERCONTEXT_SERVER_RUNTIME_*``: role, mode, database URL, lease timing, HTTP port); the
registry is ``tests.replicas.families.registry`` (``--registry scale``: the four scale-out
families). The only test-specific knob is a short failure backoff (``--backoff-base``) so that
crashed Workers are retried in about a second instead of the RFC's 30 s.

With role ``api`` the process also runs a request writer, as an application embedding apsup's API
role would: each request is accepted in one transaction together with a ``replica_accepted`` row
(the domain input), so every accepted request is known to the checker. The writer stops after
``--requests`` requests or when the file ``<info>.stop-writer`` appears.

Once serving, the replica writes ``--info`` (JSON: pid, http port, holder id) atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
from pathlib import Path

from sqlalchemy import insert

from apsup.config import Settings
from apsup.scheduling import Backoff
from apsup.store import open_backend
from apsup.supervisor.runtime import Runtime
from tests.replicas import families


def write_requests(
    url: str, count: int, interval: float, scopes: int, stop_file: Path, done_file: Path
) -> None:
    backend = open_backend(url)
    rng = random.Random(os.getpid())
    fams = [families.work] if scopes > 0 else []
    n = 0
    try:
        while n < count and not stop_file.exists():
            fam = fams[0]
            scope = f"s{rng.randrange(scopes)}"
            try:
                with backend.transaction() as conn:
                    g = fam.request(conn, scope)
                    conn.execute(
                        insert(families.accepted).values(family=fam.name, scope_id=scope, g=g)
                    )
                n += 1
            except Exception as exc:  # the database may be briefly unavailable: keep going
                print(f"replica writer: {type(exc).__name__}", file=sys.stderr, flush=True)
            threading.Event().wait(interval)
    finally:
        backend.dispose()
        done_file.write_text(str(n))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--info", required=True)
    parser.add_argument("--requests", type=int, default=0)
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--scopes", type=int, default=20)
    parser.add_argument("--backoff-base", type=float, default=0.5)
    parser.add_argument("--registry", choices=sorted(families.REGISTRIES), default="default")
    args = parser.parse_args(argv)

    registry = families.REGISTRIES[args.registry]
    settings = Settings.load(registry)
    backoff = Backoff(base=args.backoff_base, factor=2.0, cap=args.backoff_base * 4, jitter=0.1)
    runtime = Runtime(settings, registry, backoff=backoff, configure_logs=True)
    info = Path(args.info)

    def publish() -> None:
        runtime.started.wait()
        host = runtime.host
        data = {
            "pid": os.getpid(),
            "port": runtime.http_port,
            "holder_id": host.holder_id if host is not None else None,
            "role": settings.role,
        }
        tmp = info.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, info)
        if settings.role == "api" and args.requests > 0:
            write_requests(
                settings.database_url,
                args.requests,
                args.interval,
                args.scopes,
                Path(str(info) + ".stop-writer"),
                Path(str(info) + ".writer-done"),
            )

    threading.Thread(target=publish, name="replica-publish", daemon=True).start()
    runtime.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
