"""``python -m tests.visibility_runner URL [KEY=VALUE ...]``: a real ``Runtime`` on the main
thread (apsup's own JSON log handler, real SIGTERM/SIGINT handling) for the Families of
``tests.visibility_families``. Prints ``READY <http port>`` on stdout once the loop runs.
"""

from __future__ import annotations

import os
import sys
import threading

from apsup.config import Settings
from apsup.scheduling import Backoff
from apsup.supervisor.runtime import Runtime
from tests.visibility_families import registry

PREFIX = "POWERCONTEXT_SERVER_RUNTIME_"


def _export_spans_to(path: str) -> None:
    """An SDK provider writing each finished span as one JSON line (the application's part)."""
    import json
    from collections.abc import Sequence

    from opentelemetry import trace
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (
        SimpleSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class FileExporter(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            with open(path, "a", encoding="utf-8") as fh:
                for span in spans:
                    ctx = span.get_span_context()
                    assert ctx is not None
                    doc = {
                        "name": span.name,
                        "trace_id": format(ctx.trace_id, "032x"),
                        "span_id": format(ctx.span_id, "016x"),
                        "attributes": dict(span.attributes or {}),
                        "status": span.status.status_code.name,
                    }
                    fh.write(json.dumps(doc) + "\n")
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(FileExporter()))
    trace.set_tracer_provider(provider)


def main(argv: list[str]) -> int:
    env = {
        PREFIX + "DATABASE_URL": argv[0],
        PREFIX + "ARTIFACT_PROCESSING_ROLE": "all",
        PREFIX + "ARTIFACT_PROCESSING_SUPERVISOR_MODE": "global",
        PREFIX + "LEASE_SECONDS": "3",
        PREFIX + "RENEW_SECONDS": "1",
        PREFIX + "POLL_SECONDS": "0.5",
        PREFIX + "HTTP_PORT": "0",
        PREFIX + "LOG_FORMAT": "json",
        PREFIX + "LOG_LEVEL": "INFO",
        # The tests stop the host with its processors still running (hung on purpose): no
        # drain to wait out at the end (the default waits 30 s for them).
        PREFIX + "SHUTDOWN_DRAIN_SECONDS": "0",
        PREFIX + "SHUTDOWN_GRACE_SECONDS": "2",
    }
    for item in argv[1:]:
        key, _, value = item.partition("=")
        env[PREFIX + key] = value
    trace_file = os.environ.get("VIS_TRACE_FILE")
    if trace_file:
        _export_spans_to(trace_file)
    settings = Settings.load(registry, env=env)
    runtime = Runtime(settings, registry, backoff=Backoff(base=60.0, cap=60.0), configure_logs=True)

    def announce() -> None:
        runtime.started.wait()
        print(f"READY {runtime.http_port}", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    runtime.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
