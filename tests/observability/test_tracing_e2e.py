"""OpenTelemetry's Celery instrumentation links an API server's save to the worker's span.

The producer side (this test process) runs the instrumentation with an in-memory exporter;
the default (coalescing) worker loads it with ``-I`` (tests/support/otel_worker.py). The
Python client's fast path runs ``before_task_publish``, so the instrumentation's producer
span injects ``traceparent``; the worker pushes it in ``task.request`` for each request of a
group, so each save gets one consumer span, the child of its producer span.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.worker.settings import Settings
from tests.observability.conftest import CHECKPOINTQ
from tests.support.celery_processes import CeleryProcess, checkpointq_env
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import wait_until

pytestmark = pytest.mark.integration


class Started(SpanProcessor):
    """Every span started here. OpenTelemetry ends a producer span in after_task_publish
    only if the task is registered in this process's Celery app (it is not: an API server
    only names it), so the exporter never sees them; their ids are what the worker's spans
    must point at."""

    def __init__(self) -> None:
        self.spans: list[Span] = []

    def on_start(self, span: Span, parent_context: Any = None) -> None:
        self.spans.append(span)


@pytest.fixture
def tracing() -> Iterator[tuple[TracerProvider, InMemorySpanExporter, Started]]:
    provider, exporter, started = TracerProvider(), InMemorySpanExporter(), Started()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.add_span_processor(started)
    instrumentor = CeleryInstrumentor()  # type: ignore[no-untyped-call]
    instrumentor.instrument(tracer_provider=provider)
    try:
        yield provider, exporter, started
    finally:
        instrumentor.uninstrument()


def test_each_save_gets_one_consumer_span_child_of_its_producer_span(
    worker_values: dict[str, object],
    tmp_path: Path,
    tracing: tuple[TracerProvider, InMemorySpanExporter, Started],
) -> None:
    provider, exporter, started = tracing
    span_log = tmp_path / "spans.jsonl"
    env = checkpointq_env(**worker_values) | {"CQ_SPAN_LOG": str(span_log)}
    # Given a default worker with OpenTelemetry loaded by -I
    worker = CeleryProcess(
        "worker", env, command=[CHECKPOINTQ, "worker", "-I", "tests.support.otel_worker"]
    ).start()
    try:
        # When an API server saves 10 checkpoints, each inside a span of its own
        tracer = provider.get_tracer("apiserver")
        requests: dict[str, str] = {}
        with CheckpointClient.from_settings(Settings(**worker_values)) as client:  # type: ignore[arg-type]
            for n in range(10):
                with tracer.start_as_current_span(f"request-{n}") as outer:
                    handle = client.save(make_checkpoint(f"otel-{n}"))
                requests[handle.task_id] = f"{outer.get_span_context().trace_id:032x}"

        def consumer_spans() -> list[dict[str, Any]]:
            if not span_log.exists():
                return []
            lines = [json.loads(line) for line in span_log.read_text().splitlines()]
            return [s for s in lines if s["kind"] == "CONSUMER" and s["task_id"] in requests]

        wait_until(
            lambda: {s["task_id"] for s in consumer_spans()} == set(requests),
            timeout=30,
            message="a consumer span per save",
        )
    finally:
        code = worker.stop()
        print(f"--- worker log (exit {code}) ---\n{worker.log()}")
    # Then each save has exactly one consumer span, in its request's trace, whose parent is
    # the producer span the client's publish made for that save
    producers = {
        s.attributes["messaging.message.id"]: s
        for s in started.spans
        if s.kind.name == "PRODUCER" and s.attributes
    }
    spans = consumer_spans()
    assert len(spans) == len(requests)
    for span in spans:
        producer: ReadableSpan = producers[span["task_id"]]
        assert span["name"] == "run/checkpoint.save_staged"  # the client's saves
        assert span["trace_id"] == requests[span["task_id"]]
        assert span["parent_span_id"] == f"{producer.context.span_id:016x}"
    assert exporter.get_finished_spans(), "the API server's own spans were exported"
