"""In-process helpers for the role/mode/takeover tests: settings, a Runtime on a thread, HTTP."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import orjson

from apsup.config import Settings
from apsup.registry import Registry
from apsup.scheduling import Backoff
from apsup.supervisor.runtime import Runtime
from tests.replicas import families

PREFIX = "POWERCONTEXT_SERVER_RUNTIME_"
FAST_BACKOFF = Backoff(base=0.3, factor=2.0, cap=1.2, jitter=0.1)


def settings_for(
    url: str,
    *,
    role: str = "all",
    mode: str = "global",
    registry: Registry | None = None,
    http: bool = True,
    **extra: str,
) -> Settings:
    env = {
        PREFIX + "DATABASE_URL": url,
        PREFIX + "ARTIFACT_PROCESSING_ROLE": role,
        PREFIX + "ARTIFACT_PROCESSING_SUPERVISOR_MODE": mode,
        PREFIX + "LEASE_SECONDS": "3",
        PREFIX + "RENEW_SECONDS": "1",
        PREFIX + "POLL_SECONDS": "0.5",
        PREFIX + "SHUTDOWN_GRACE_SECONDS": "3",
    }
    if http:
        env[PREFIX + "HTTP_PORT"] = "0"
    env.update({PREFIX + k: v for k, v in extra.items()})
    return Settings.load(registry or families.registry, env=env)


@contextmanager
def running(runtime: Runtime, timeout: float = 60.0) -> Iterator[Runtime]:
    """Run ``runtime.run()`` on a thread (no signal handlers there); stop and join on exit."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            runtime.run()
        except BaseException as exc:  # surfaced to the test below
            errors.append(exc)

    thread = threading.Thread(target=target, name="runtime-under-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not runtime.started.is_set():
        if errors:
            raise errors[0]
        if not thread.is_alive():
            raise AssertionError("runtime exited before starting")
        assert time.monotonic() < deadline, "runtime did not start"
        time.sleep(0.02)
    try:
        yield runtime
    finally:
        runtime.stop()
        thread.join(60)
        assert not thread.is_alive(), "runtime did not stop"
    if errors:
        raise errors[0]


def http_get(port: int, path: str) -> tuple[int, Any]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, orjson.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, orjson.loads(exc.read())


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def request(url: str, fam_name: str, scope: str) -> int:
    """Accept a request as domain code would (own transaction), then notify a local host."""
    from apsup.store import open_backend
    from apsup.supervisor.control import notify

    backend = open_backend(url)
    try:
        fam = families.registry.get(fam_name)
        with backend.transaction() as conn:
            return fam.request(conn, scope)
    finally:
        backend.dispose()
        notify(url, fam_name)  # SQLite hosts wake on notifications, never by polling


def handled(url: str, fam_name: str, scope: str) -> int:
    from apsup.store import intents, open_backend

    backend = open_backend(url)
    try:
        with backend.read() as conn:
            row = intents.get(conn, families.registry.get(fam_name).binding_name, scope)
        return 0 if row is None else row.handled_generation
    finally:
        backend.dispose()
