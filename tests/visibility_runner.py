"""``python -m tests.visibility_runner URL [KEY=VALUE ...]``: a real ``Runtime`` on the main
thread (apsup's own JSON log handler, real SIGTERM/SIGINT handling) for the Families of
``tests.visibility_families``. Prints ``READY <http port>`` on stdout once the loop runs.
"""

from __future__ import annotations

import sys
import threading

from apsup.config import Settings
from apsup.scheduling import Backoff
from apsup.supervisor.runtime import Runtime
from tests.visibility_families import registry

PREFIX = "POWERCONTEXT_SERVER_RUNTIME_"


def main(argv: list[str]) -> int:
    env = {
        PREFIX + "DATABASE_URL": argv[0],
        PREFIX + "ARTIFACT_PROCESSING_ROLE": "all",
        PREFIX + "ARTIFACT_PROCESSING_SUPERVISOR_MODE": "global",
        PREFIX + "LEASE_SECONDS": "3",
        PREFIX + "RENEW_SECONDS": "1",
        PREFIX + "POLL_SECONDS": "0.5",
        PREFIX + "HTTP_PORT": "0",
        PREFIX + "LOG_FORMAT": "json",
        PREFIX + "LOG_LEVEL": "INFO",
    }
    for item in argv[1:]:
        key, _, value = item.partition("=")
        env[PREFIX + key] = value
    settings = Settings.load(registry, env=env)
    runtime = Runtime(settings, registry, backoff=Backoff(base=60.0, cap=60.0), configure_logs=True)

    def announce() -> None:
        runtime.started.wait()
        print(f"READY {runtime.http_port}", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    runtime.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
