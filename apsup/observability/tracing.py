"""Optional OpenTelemetry tracing (``pip install 'apsup[otel]'``: opentelemetry-api only).

With the API installed, the host opens one span per invocation, from dispatch to confirmed exit
(``apsup.invocation``: family, binding, scope, worker_id, term, request_generation, outcome),
and passes its W3C trace context to the Worker in the ExecutionContext; the Worker makes it the
current context before calling the processor, so the processor's own spans nest under it. JSON
log records carry ``trace_id`` / ``span_id`` of the current span. Exporting is the application's
business: configure an SDK ``TracerProvider`` in the host process as usual; without one every
span is a no-op and no trace context is sent.

Without the package nothing is imported: :func:`enabled` only asks the import system whether
the package exists, and :func:`current_ids` only looks at modules already imported.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import OrderedDict
from typing import Any

_enabled: bool | None = None
MAX_OPEN_SPANS = 10000


def enabled() -> bool:
    """Whether ``opentelemetry-api`` is installed (checked once, without importing it)."""
    global _enabled
    if _enabled is None:
        try:
            _enabled = importlib.util.find_spec("opentelemetry") is not None
        except (ImportError, ValueError):
            _enabled = False
    return _enabled


def current_ids() -> dict[str, str]:
    """``trace_id``/``span_id`` of the current span, if tracing is in use in this process."""
    mod = sys.modules.get("opentelemetry.trace")
    if mod is None:
        return {}
    try:
        sc = mod.get_current_span().get_span_context()
        if not sc.is_valid:
            return {}
        return {"trace_id": format(sc.trace_id, "032x"), "span_id": format(sc.span_id, "016x")}
    except Exception:
        return {}


class InvocationSpans:
    """Host side: the open invocation spans, by Worker id (bounded)."""

    def __init__(self) -> None:
        from opentelemetry import trace

        self._tracer = trace.get_tracer("apsup")
        self._spans: OrderedDict[str, Any] = OrderedDict()

    def start(self, worker_id: str, attributes: dict[str, Any]) -> dict[str, str]:
        """Open the span; returns the trace context to hand to the Worker ({} if not sampled)."""
        from opentelemetry import propagate, trace

        span = self._tracer.start_span(
            "apsup.invocation", kind=trace.SpanKind.CONSUMER, attributes=attributes
        )
        if not span.get_span_context().is_valid:
            return {}
        self._spans[worker_id] = span
        while len(self._spans) > MAX_OPEN_SPANS:  # launch failures never report an exit
            self._spans.popitem(last=False)[1].end()
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def end(self, worker_id: str, cause: str | None) -> None:
        span = self._spans.pop(worker_id, None)
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("apsup.outcome", cause or "success")
        if cause is not None:
            span.set_status(Status(StatusCode.ERROR, cause))
        span.end()


def attach_context(carrier: dict[str, str]) -> None:
    """Worker side: make the host's invocation span the current context (no-op without one)."""
    if not carrier or not enabled():
        return
    from opentelemetry import context, propagate

    context.attach(propagate.extract(carrier))
