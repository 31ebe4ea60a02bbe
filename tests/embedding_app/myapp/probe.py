"""With MYAPP_PROBE=<file>, every statement any engine of this process runs is appended to the
file as ``<pid> <time> <first word>``: the test reads the host's lines to see it idle."""

import os
import time

from sqlalchemy import Engine, event

PROBE = os.environ.get("MYAPP_PROBE")

if PROBE:

    @event.listens_for(Engine, "before_cursor_execute")
    def _statement(conn, cursor, statement, *args):
        with open(PROBE, "a") as out:
            out.write(f"{os.getpid()} {time.time():.6f} {statement.split(None, 1)[0]}\n")
