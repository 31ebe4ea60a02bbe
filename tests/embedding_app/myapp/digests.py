"""``digest``: an interval family; dirty Scopes are admitted by its automatic checks."""

import os
import time

from sqlalchemy import insert

from apsup import family
from myapp import probe  # noqa: F401
from myapp.db import runs


@family("digest", interval=1, max_workers=2, timeout=30)
def digest(scope_id, ctx):
    with ctx.fenced() as conn:
        dirty = ctx.dirty_generation(conn)
        conn.execute(
            insert(runs).values(
                family="digest", scope_id=scope_id, started=time.time(), pid=os.getpid()
            )
        )
        ctx.mark_clean(conn, dirty)
        ctx.acknowledge(conn)
