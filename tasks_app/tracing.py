"""OpenTelemetry spans: `send <queue>` for every enqueue, `process <queue>` for every run, linked by the envelope.

Only the API is used: the project's SDK decides where spans go; without the `otel` extra nothing happens, and
without an SDK a task's context is only passed on to the tasks its handler enqueues (docs/tracing.md).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any, NamedTuple

try:
    from opentelemetry import context as otel_context, propagate, trace
    from opentelemetry.trace import (
        INVALID_SPAN,
        Link,
        NoOpTracerProvider,
        ProxyTracerProvider,
        Span,
        SpanKind,
        Status,
        StatusCode,
    )

    INSTALLED = True
except ImportError:  # the `otel` extra is not installed
    INSTALLED = False

SYSTEM = "tasks_app"  # messaging.system: the queue's own protocol, not Redis's
# The settings of TASKS_TRACE_PROPAGATION: a run's span is a child of its send span, or linked to it.
CHILD, LINK = "child", "link"
PROPAGATIONS = (CHILD, LINK)
# What ended a run, as `tasks_app.task.outcome` says.
SUCCEEDED = "succeeded"
RETRIED = "retried"
DEAD_LETTERED = "dead_lettered"
CANCELLED = "cancelled"
DEFERRED = "deferred"
ABANDONED = "abandoned"
_FAILURES = (RETRIED, DEAD_LETTERED, ABANDONED)
FLUSH_TIMEOUT_MS = 5000


@functools.cache
def _tracer() -> Any:
    # At the first span, not at import; a provider set later is used too (the API's proxy).
    return trace.get_tracer("tasks_app")


def _recording() -> bool:
    """Whether an SDK is set up: without one, spans would record nothing, and only the context is passed on."""
    return not isinstance(trace.get_tracer_provider(), ProxyTracerProvider | NoOpTracerProvider)


@functools.cache
def _fields(propagator: Any) -> frozenset[str]:
    """The header names `propagator` reads and writes (`traceparent`, `tracestate`, `baggage` by default)."""
    return frozenset(propagator.fields)


class Sends:
    """The send spans of one enqueue call: one per queue (not per task), begun at its first task, ended by the push."""

    __slots__ = ("_headers", "_spans")

    def __init__(self) -> None:
        self._spans: dict[str, Any] = {}
        self._headers: dict[str, dict[str, str]] = {}

    def stamp(self, queue: str, headers: MutableMapping[str, str]) -> None:
        """Write the trace context of `queue`'s send span into a task's headers (nothing without a trace)."""
        if not INSTALLED:
            return
        carrier = self._headers.get(queue)
        if carrier is None and not _recording():  # the current context only passes through
            carrier = self._headers[queue] = {}
            if otel_context.get_current():  # else there is nothing to pass on
                propagate.inject(carrier)
        elif carrier is None:
            span = _tracer().start_span(
                f"send {queue}",
                kind=SpanKind.PRODUCER,
                attributes={
                    "messaging.system": SYSTEM,
                    "messaging.operation.type": "send",
                    "messaging.operation.name": "send",
                    "messaging.destination.name": queue,
                },
            )
            carrier = {}
            propagate.inject(carrier, context=trace.set_span_in_context(span))
            self._spans[queue], self._headers[queue] = span, carrier
        headers.update(carrier)

    def end(self, sent: Iterable[tuple[str, str]], error: BaseException | None = None) -> None:
        """End every span: `sent` lists the (queue, task id) of the call's tasks; `error` if the push failed."""
        spans, self._spans = self._spans, {}
        if not spans:
            return
        ids: dict[str, list[str]] = {}
        for queue, task_id in sent:
            ids.setdefault(queue, []).append(task_id)
        for queue, span in spans.items():
            if span.is_recording():
                queue_ids = ids.get(queue, [])
                if len(queue_ids) == 1:  # the conventions: a message id on a single message's span, else a count
                    span.set_attribute("messaging.message.id", queue_ids[0])
                else:
                    span.set_attribute("messaging.batch.message_count", len(queue_ids))
                if error is not None:
                    _failed(span, error)
            span.end()


def restamp(headers: MutableMapping[str, str], sends: Sends, queue: str) -> None:
    """Replace whatever trace context `headers` carry by `queue`'s send span's (a requeue starts afresh)."""
    if not INSTALLED:
        return
    for name in _fields(propagate.get_global_textmap()):
        headers.pop(name, None)
    sends.stamp(queue, headers)


class RunSpan(NamedTuple):
    """A run's `process` span (None without an SDK), and its handler's context (with the producer's baggage)."""

    span: Any
    context: Any


def start_run(
    headers: Mapping[str, str], task_id: str, task_type: str, queue: str, attempt: int, consumer_id: str, link: bool
) -> RunSpan | None:
    """Start the `process` span of a run: a child of the context in `headers`, or linked to it if `link`."""
    if not INSTALLED:
        return None
    if not _recording():  # no span: the task's context is passed on to the tasks its handler enqueues
        propagator = propagate.get_global_textmap()
        if _fields(propagator).isdisjoint(headers):
            return None
        return RunSpan(None, propagator.extract(headers))
    sent = propagate.extract(headers)
    links = None
    if link:
        producer = trace.get_current_span(sent).get_span_context()
        links = [Link(producer)] if producer.is_valid else None
        sent = trace.set_span_in_context(INVALID_SPAN, sent)  # a root span, keeping the baggage
    span = _tracer().start_span(
        f"process {queue}",
        context=sent,
        kind=SpanKind.CONSUMER,
        links=links,
        attributes={
            "messaging.system": SYSTEM,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": queue,
            "messaging.message.id": task_id,
            "messaging.client.id": consumer_id,
            "tasks_app.task.type": task_type,
            "tasks_app.task.attempt": attempt,
        },
    )
    return RunSpan(span, trace.set_span_in_context(span, sent))


@contextlib.contextmanager
def current(run: RunSpan | None) -> Iterator[None]:
    """Make the run's span current meanwhile: the handler's own spans nest under it."""
    if run is None:
        yield
        return
    token = otel_context.attach(run.context)
    try:
        yield
    finally:
        otel_context.detach(token)


def end_run(run: RunSpan | None, outcome: str, error: BaseException | None) -> None:
    """End a run's span with its outcome; a failure records its exception and sets the status to ERROR."""
    if run is None or run.span is None:
        return
    span: Span = run.span
    if span.is_recording():
        span.set_attribute("tasks_app.task.outcome", outcome)
        if error is not None and outcome in _FAILURES:
            _failed(span, error)
    span.end()


def flush() -> None:
    """Export the spans an SDK still buffers (before the process exits without its exit handlers)."""
    if not INSTALLED:
        return
    force_flush = getattr(trace.get_tracer_provider(), "force_flush", None)  # an SDK's provider has it
    if force_flush is not None:
        force_flush(FLUSH_TIMEOUT_MS)


def _failed(span: Span, error: BaseException) -> None:
    span.record_exception(error)
    span.set_attribute("error.type", f"{type(error).__module__}.{type(error).__qualname__}")
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:1000]))
