"""Series that show a stall (is anything stuck, which Family, since when), plus build info.

``apsup_oldest_running_seconds`` is computed when scraped, not when the loop last ran: a loop
that sleeps until a hung Worker's deadline must still show that Worker's age growing. The loop
only publishes each Family's oldest launch time (``time.monotonic()``); the collector subtracts.
``apsup_last_success_timestamp_seconds`` starts at the process start time, so "no success for N
intervals" counts from the later of the last success and the restart (a restart is not a stall).
"""

from __future__ import annotations

import platform
import threading
import time
from collections.abc import Iterator
from importlib import metadata

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

OLDEST_RUNNING = "apsup_oldest_running_seconds"


def build_version() -> str:
    try:
        return metadata.version("apsup")
    except metadata.PackageNotFoundError:
        return "unknown"


def install_default_collectors(registry: CollectorRegistry) -> None:
    """``process_*``, ``python_info`` and ``python_gc_*`` on a private registry.

    The global registry already has them; re-registering there would raise a duplicate error.
    """
    from prometheus_client import REGISTRY

    if registry is REGISTRY:
        return
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


class StallCollector(Collector):
    """Owns the stall gauges; itself collects ``apsup_oldest_running_seconds`` at scrape time."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._lock = threading.Lock()
        self._oldest: dict[str, float | None] = {}
        self._started = time.time()
        fam = ("family",)
        self.last_success = Gauge(
            "apsup_last_success_timestamp_seconds",
            "Unix time of the last acknowledged success (the process start before the first).",
            fam,
            registry=registry,
        )
        self.max_failures = Gauge(
            "apsup_retry_wait_max_consecutive_failures",
            "Highest consecutive-failure count among the Family's Scopes.",
            fam,
            registry=registry,
        )
        self.interval = Gauge(
            "apsup_family_check_interval_seconds",
            "Automatic check interval of the Family (0 for cron or disabled).",
            fam,
            registry=registry,
        )
        self.timeout = Gauge(
            "apsup_family_timeout_seconds",
            "Worker timeout of the Family (a Worker older than this should have been stopped).",
            fam,
            registry=registry,
        )
        self.build_info = Gauge(
            "apsup_build_info",
            "Always 1; the labels say which apsup and Python this process runs.",
            ("version", "python"),
            registry=registry,
        )
        self.build_info.labels(build_version(), platform.python_version()).set(1)
        registry.register(self)

    def init_family(self, family: str) -> None:
        with self._lock:
            self._oldest.setdefault(family, None)
        self.last_success.labels(family).set(self._started)
        self.max_failures.labels(family)
        self.interval.labels(family)
        self.timeout.labels(family)

    def set(self, family: str, oldest_started: float | None, max_failures: int) -> None:
        with self._lock:
            self._oldest[family] = oldest_started
        self.max_failures.labels(family).set(max_failures)

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(OLDEST_RUNNING, "", labels=["family"])

    def collect(self) -> Iterator[Metric]:
        now = time.monotonic()
        metric = GaugeMetricFamily(
            OLDEST_RUNNING,
            "Age of the Family's oldest running invocation (0 when none runs).",
            labels=["family"],
        )
        with self._lock:
            items = sorted(self._oldest.items())
        for family, started in items:
            metric.add_metric([family], 0.0 if started is None else max(0.0, now - started))
        yield metric
