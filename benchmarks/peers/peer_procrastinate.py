"""Procrastinate app for benchmarks/peers (PostgreSQL; the job row is updated when it ends).

``work(concurrency, wait)`` runs a worker on queue ``bench`` (driver.py imports this module, so
the app is not instantiated in ``__main__``)."""

import os

from _marker import mark
from procrastinate import App, PsycopgConnector

app = App(
    connector=PsycopgConnector(
        conninfo=os.environ.get(
            "PEERS_PG", "postgresql://apsup_bench:apsup_bench@127.0.0.1:5432/apsup_bench"
        )
    )
)


@app.task(name="noop", queue="bench")
async def noop(task_id: int, enqueued: float) -> None:
    mark(task_id, enqueued)


def work(concurrency: int, wait: bool) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    app.run_worker(queues=["bench"], concurrency=concurrency, wait=wait)
