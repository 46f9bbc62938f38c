"""A module for ``checkpointq worker -I``: OpenTelemetry's Celery instrumentation, as its
docs set it up for a prefork worker (in ``worker_process_init``), exporting each finished
span as one JSON line to ``$CQ_SPAN_LOG`` (the test reads them from there)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from celery import signals
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult


class LineExporter(SpanExporter):
    """Appends each span (name, kind, ids, task id) to a file, one short write per span."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            context, parent = span.context, span.parent
            line = {
                "name": span.name,
                "kind": span.kind.name,
                "trace_id": f"{context.trace_id:032x}",
                "span_id": f"{context.span_id:016x}",
                "parent_span_id": f"{parent.span_id:016x}" if parent else None,
                "task_id": (span.attributes or {}).get("messaging.message.id"),
            }
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, (json.dumps(line) + "\n").encode())
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS


def _instrument(**_: Any) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(LineExporter(os.environ["CQ_SPAN_LOG"])))
    CeleryInstrumentor().instrument(tracer_provider=provider)  # type: ignore[no-untyped-call]


signals.worker_process_init.connect(_instrument, weak=False)
