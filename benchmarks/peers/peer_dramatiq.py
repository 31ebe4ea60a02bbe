"""Dramatiq broker and actor for benchmarks/peers (Redis broker; acknowledged after the run)."""

import os

import dramatiq
from _marker import mark
from dramatiq.brokers.redis import RedisBroker

broker = RedisBroker(url=os.environ.get("PEERS_REDIS", "redis://127.0.0.1:6379/0"))
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name="bench", max_retries=0)
def noop(task_id: int, enqueued: float) -> None:
    mark(task_id, enqueued)
