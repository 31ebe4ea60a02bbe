"""A separate publisher process of the wake-up tests (copied beside ``wakeapp``)::

    python publish.py URL ACTION FAMILY SCOPE [ENGINE]

ACTION ``request`` | ``mark_dirty`` | ``bypass`` (``intents.request`` directly: the commit is
invisible to apsup's commit hook, as with a raw or non-SQLAlchemy writer). FAMILY ``manual`` |
``hourly``. ENGINE ``plain`` (``create_engine(URL)``, the user's own engine) or ``apsup``
(``apsup.connect(URL)``). The intent commits in one transaction with a row of the application's
own table. Prints JSON: wall-clock times just before the transaction and just after the commit.
"""

from __future__ import annotations

import json
import sys
import time

from sqlalchemy import Engine, create_engine, insert
from wakeapp import families as app


def main(url: str, action: str, which: str, scope: str, kind: str = "plain") -> None:
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
