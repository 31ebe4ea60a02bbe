"""Fixtures of the acceptance tests: a migrated store with the business tables, and host
factories whose hosts (in-process or subprocess) are always stopped at teardown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from apsup.registry import Family
from apsup.store import SqlBackend
from tests.acceptance import families as fams
from tests.acceptance.harness import HostProcess, LiveHost


@pytest.fixture
def store(backend: SqlBackend) -> SqlBackend:
    """The migrated backend of a fresh database, with the acceptance business tables."""
    fams.create_tables(backend.engine)
    return backend


class Hosts:
    """Creates hosts for one test and stops every one of them at teardown."""

    def __init__(self, url: str, workdir: Path) -> None:
        self.url = url
        self.workdir = workdir
        self.live: list[LiveHost] = []
        self.procs: list[HostProcess] = []

    def live_host(self, families: list[Family], **kwargs: Any) -> LiveHost:
        host = LiveHost(self.url, families, **kwargs)
        self.live.append(host)
        return host

    def process(self, families: dict[str, dict[str, Any]], **config: Any) -> HostProcess:
        name = f"host{len(self.procs) + 1}"
        proc = HostProcess(self.workdir, name, {"db": self.url, "families": families, **config})
        self.procs.append(proc)
        return proc.start()

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        for host in self.live:
            host.close()


@pytest.fixture
def hosts(store: SqlBackend, tmp_path: Path) -> Iterator[Hosts]:
    h = Hosts(store.url, tmp_path)
    try:
        yield h
    finally:
        h.close()
