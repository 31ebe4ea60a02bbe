"""A replica cluster whose background replicas each reach the server through their own TCP
fault proxy, so one replica can be cut off (black hole, reset, latency) while the others are
not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.faults.proxy import FaultProxy
from tests.replicas.cluster import PREFIX, Cluster, Replica


class PartitionCluster(Cluster):
    """A Cluster whose background replicas each reach the server through their own proxy."""

    def __init__(
        self, url: str, workdir: Path, *, deadline: float | None = None, **kwargs: Any
    ) -> None:
        super().__init__(url, workdir, **kwargs)
        self.deadline = deadline
        self.proxies: dict[str, FaultProxy] = {}
        self._next_url: str | None = None

    def env(self, role: str) -> dict[str, str]:
        env = super().env(role)
        if self._next_url is not None:
            env[PREFIX + "DATABASE_URL"] = self._next_url
        if self.deadline is not None:
            env[PREFIX + "RENEW_DEADLINE_SECONDS"] = str(self.deadline)
        return env

    def start(
        self, role: str = "background", *args: str, env: dict[str, str] | None = None
    ) -> Replica:
        proxy = FaultProxy.for_url(self.url).start()
        self._next_url = proxy.url(self.url)
        try:
            replica = super().start(role, *args, env=env)
        finally:
            self._next_url = None
        self.proxies[replica.name] = proxy
        return replica

    def close(self) -> None:
        try:
            super().close()
        finally:
            for proxy in self.proxies.values():
                proxy.stop()
