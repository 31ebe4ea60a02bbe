"""apsup family for benchmarks/peers, and a host process for it.

``main(URL, CONCURRENCY)`` (driver.py imports this module) runs a host (``build_host``) with the
no-op family at ``max_workers=CONCURRENCY`` until SIGTERM.
The Scope id carries ``<task id>:<enqueue time>``."""

import signal

from _marker import mark

from apsup.registry import Registry, family

registry = Registry()


@family("peers-noop", max_workers=2, timeout=60, registry=registry)
def noop(scope_id: str, ctx: object) -> None:
    task_id, enqueued = scope_id.split(":")
    mark(int(task_id), float(enqueued))


def main(url: str, concurrency: int) -> None:
    from apsup.supervisor.launcher import build_host

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    bundle = build_host(url, [noop.with_overrides(max_workers=concurrency)], shutdown_grace=5.0)
    try:
        bundle.host.start()
        while not stop:
            bundle.host.cycle(max_wait=0.2)
        bundle.host.shutdown()
    finally:
        bundle.close()
