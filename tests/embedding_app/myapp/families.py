"""``report``: automatic admission disabled, runs only on requests."""

import os
import time

from sqlalchemy import insert

from apsup import family
from myapp import probe  # noqa: F401  (records the host's statements when asked)
from myapp.db import runs


@family("report", max_workers=2, timeout=30)
def report(scope_id, ctx):
    with ctx.fenced() as conn:
        conn.execute(
            insert(runs).values(
                family="report", scope_id=scope_id, started=time.time(), pid=os.getpid()
            )
        )
        ctx.acknowledge(conn)
