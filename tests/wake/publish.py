"""A separate publisher process of the wake-up tests (copied beside ``wakeapp``)::

    python publish.py URL ACTION FAMILY SCOPE [ENGINE]

ACTION ``request`` | ``mark_dirty`` | ``bypass`` (``intents.request`` directly: the commit is
invisible to apsup's commit hook, as with a raw or non-SQLAlchemy writer). FAMILY ``manual`` |
``hourly``. ENGINE ``plain`` (``create_engine(URL)``, the user's own engine), ``apsup``
(``apsup.connect(URL)``) or ``async`` (the user's own ``sqlite+aiosqlite`` AsyncEngine and
``request_async`` / ``mark_dirty_async``). The intent commits in one transaction with a row of
the application's own table. Prints JSON: wall-clock times just before the transaction and just
after the commit.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from sqlalchemy import Engine, create_engine, insert
from wakeapp import families as app


async def publish_async(url: str, action: str, which: str, scope: str) -> dict[str, float]:
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(url.replace("sqlite://", "sqlite+aiosqlite://", 1))
    fam = app.manual if which == "manual" else app.hourly
    before = time.time()
    async with engine.begin() as conn:
        await conn.execute(
            insert(app.runs).values(family="publisher", scope_id=scope, started=before, pid=0)
        )
        if action == "request":
            generation = await fam.request_async(conn, scope)
        else:
            generation = await fam.mark_dirty_async(conn, scope)
    after = time.time()
    await engine.dispose()
    return {"before": before, "committed": after, "generation": generation}


def main(url: str, action: str, which: str, scope: str, kind: str = "plain") -> None:
    if kind == "async":
        print(json.dumps(asyncio.run(publish_async(url, action, which, scope))))
        return
    if kind == "apsup":
        import apsup

        engine: Engine = apsup.connect(url)
    else:
        engine = create_engine(url)
    fam = app.manual if which == "manual" else app.hourly
    before = time.time()
    with engine.begin() as conn:
        conn.execute(
            insert(app.runs).values(family="publisher", scope_id=scope, started=before, pid=0)
        )
        if action == "request":
            generation = fam.request(conn, scope)
        elif action == "mark_dirty":
            generation = fam.mark_dirty(conn, scope)
        else:
            from apsup.store import intents

            generation = intents.request(conn, fam.binding_name, scope)
    after = time.time()
    engine.dispose()
    print(json.dumps({"before": before, "committed": after, "generation": generation}))


if __name__ == "__main__":
    main(*sys.argv[1:])
