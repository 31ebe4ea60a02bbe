"""Celery app for benchmarks/peers: a no-op task acknowledged after it ran (``acks_late``)."""

import os

from _marker import mark
from celery import Celery

app = Celery("peer_celery", broker=os.environ.get("PEERS_REDIS", "redis://127.0.0.1:6379/0"))
app.conf.update(
    task_acks_late=True,  # the message is removed only after the task ran: durable completion
    task_ignore_result=True,
    task_default_queue="bench",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(name="noop")
def noop(task_id: int, enqueued: float) -> None:
    mark(task_id, enqueued)
