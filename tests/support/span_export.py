"""The OpenTelemetry SDK for the tracing tests: in memory in the test process, into a file in consumer processes.

A consumer process imports this module through TASK_HANDLER_MODULES; with SPANS_FILE in its environment it
installs an SDK that appends every ended span to that file as one JSON line. The handlers here open spans of
their own, to show where a handler's spans nest.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, Tracer, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tasks_app import tracing
from tasks_app.registry import handler

SPANS_FILE = "SPANS_FILE"


def as_dict(span: ReadableSpan) -> dict[str, Any]:
    """What the tests look at in a span, with ids as hex text."""
    context, parent = span.get_span_context(), span.parent
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "links": [
            {"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
            for link in span.links
        ],
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
        "events": [event.name for event in span.events],
        "baggage_seen": span.attributes.get("test.baggage") if span.attributes else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "pid": os.getpid(),
    }


class FileExporter(SpanExporter):
    """Appends each span to a file as a JSON line (one write each: consumer processes share the file)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(as_dict(span)) + "\n" for span in spans)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, lines.encode())
        finally:
            os.close(fd)
        return SpanExportResult.SUCCESS


@functools.cache
def _memory() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@contextlib.contextmanager
def in_memory() -> Iterator[InMemorySpanExporter]:
    """Trace the queue's spans of this process into memory meanwhile; the exporter starts empty.

    The SDK is not made the global provider: that is set once per process, and would trace every later test
    of this worker, writing trace headers into envelopes that other tests compare whole.
    """
    provider, exporter = _memory()
    exporter.clear()
    saved = tracing._tracer, tracing._recording
    tracing._tracer = lambda: provider.get_tracer("tasks_app")  # type: ignore[method-assign,assignment]
    tracing._recording = lambda: True
    try:
        yield exporter
    finally:
        tracing._tracer, tracing._recording = saved


def tracer() -> Tracer:
    """The tracer a test opens its own spans with (a request's, say), into the same memory."""
    return _memory()[0].get_tracer("tests")


def read_spans(path: os.PathLike[str] | str) -> list[dict[str, Any]]:
    """The spans consumer processes wrote to `path`."""
    try:
        with open(path) as lines:
            return [json.loads(line) for line in lines if line.strip()]
    except FileNotFoundError:
        return []


def _inside(name: str) -> None:
    """A span of the handler's own, noting the baggage it sees."""
    from opentelemetry import baggage

    with trace.get_tracer("tests").start_as_current_span(name) as span:
        span.set_attribute("test.baggage", str(baggage.get_baggage("tenant") or ""))


@handler("tracing.nested", takes_context=True)
def nested(context: Any, fail_attempts: int = 0) -> str:
    """Open a span of its own; fail on the first `fail_attempts` attempts."""
    _inside("inside sync")
    if context.attempt <= fail_attempts:
        raise RuntimeError(f"planned failure on attempt {context.attempt}")
    return "ok"


@handler("tracing.nested_async")
async def nested_async() -> str:
    """Open a span of its own on the asyncio lane."""
    _inside("inside async")
    return "ok"


@handler("tracing.enqueue_child")
def enqueue_child() -> str:
    """Enqueue a `tracing.nested` task on the queue `children`; its id."""
    from tasks_app.producer import enqueue

    return enqueue("tracing.nested", queue="children")[0].id


if os.environ.get(SPANS_FILE):  # a consumer process of a tracing test
    _provider = TracerProvider()
    _provider.add_span_processor(SimpleSpanProcessor(FileExporter(os.environ[SPANS_FILE])))
    trace.set_tracer_provider(_provider)
