"""Traces across real consumer processes: a view's request, its task's send span, and every run of it.

The test process traces into memory; each `runconsumer` process imports tests.support.span_export, which
installs the SDK there with a file exporter, and the test reads that file once the consumer has exited.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import baggage, context as otel_context
from opentelemetry.trace import SpanKind

from tasks_app.models import TaskType
from tasks_app.producer import enqueue
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task, decode_task, encode_task
from tests.support.span_export import SPANS_FILE, in_memory, read_spans, tracer

pytestmark = pytest.mark.django_db(transaction=True)

MODULES = "tests.support.handlers,tests.support.span_export"


def _consume(consumer_process: Any, spans_file: Path, *args: str, **env: str) -> list[dict[str, Any]]:
    """Run a burst consumer (with the SDK, exporting to `spans_file`) until its queues are idle; its spans."""
    consumer = consumer_process("--burst", *args, TASK_HANDLER_MODULES=MODULES, **{SPANS_FILE: str(spans_file)}, **env)
    assert consumer.wait(120) == 0, consumer.log()
    return read_spans(spans_file)


def _named(spans: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return sorted((span for span in spans if span["name"] == name), key=lambda span: span["start_ns"])


def _ids(span: Any) -> tuple[str, str]:
    """The (trace id, span id) of an SDK span of this process, as hex text."""
    context = span.get_span_context()
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


@pytest.fixture
def exporter():
    """The queue's spans of this process (the test's), in memory."""
    with in_memory() as spans:
        yield spans


def _send_span(exporter: Any, task_id: str) -> Any:
    [send] = [span for span in exporter.get_finished_spans() if span.kind == SpanKind.PRODUCER]
    assert send.attributes["messaging.message.id"] == task_id
    return send


def test_a_request_that_enqueues_a_retried_task_is_one_trace(staff, broker, consumer_process, tmp_path, exporter):
    TaskType.objects.create(name="traced.order", handler="tracing.nested", queue="traced", retry_backoff=0)
    with tracer().start_as_current_span("POST /api/tasks/", kind=SpanKind.SERVER) as request:
        token = otel_context.attach(baggage.set_baggage("tenant", "acme"))
        try:
            response = staff.post(
                "/api/tasks/",
                json.dumps({"type": "traced.order", "kwargs": {"fail_attempts": 1}}),
                content_type="application/json",
            )
        finally:
            otel_context.detach(token)
    assert response.status_code == 201, response.content
    task_id = response.json()["id"]
    trace_id, request_id = _ids(request)
    send = _send_span(exporter, task_id)
    send_trace, send_id = _ids(send)
    assert (send.name, send_trace, f"{send.parent.span_id:016x}") == ("send traced", trace_id, request_id)
    assert send.attributes["messaging.destination.name"] == "traced"
    assert send.attributes["messaging.operation.type"] == "send"

    spans = _consume(consumer_process, tmp_path / "spans.jsonl", "--queue", "traced")
    first, second = _named(spans, "process traced")
    for attempt, run, outcome in ((1, first, "retried"), (2, second, "succeeded")):
        assert (run["kind"], run["trace_id"], run["parent_id"], run["links"]) == ("CONSUMER", trace_id, send_id, [])
        assert run["attributes"] == {
            "messaging.system": "tasks_app",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": "traced",
            "messaging.message.id": task_id,
            "messaging.client.id": run["attributes"]["messaging.client.id"],
            "tasks_app.task.type": "traced.order",
            "tasks_app.task.attempt": attempt,
            "tasks_app.task.outcome": outcome,
            **({"error.type": "builtins.RuntimeError"} if attempt == 1 else {}),
        }
    assert (first["status"], first["events"]) == ("ERROR", ["exception"])
    assert (second["status"], second["events"]) == ("UNSET", [])
    # The handler's own spans nest under its run's, and see the request's baggage.
    inside = _named(spans, "inside sync")
    assert [(span["parent_id"], span["baggage_seen"]) for span in inside] == [
        (first["span_id"], "acme"),
        (second["span_id"], "acme"),
    ]


def test_a_run_whose_value_cannot_be_stored_ends_its_span_as_the_failure_it_is(broker, consumer_process, tmp_path):
    TaskType.objects.create(name="traced.unstorable", handler="test.not_json", queue="traced", max_attempts=1)
    [task] = enqueue("traced.unstorable")
    [run] = _named(_consume(consumer_process, tmp_path / "spans.jsonl", "--queue", "traced"), "process traced")
    assert run["attributes"]["tasks_app.task.outcome"] == "dead_lettered"
    assert run["attributes"]["error.type"] == "tasks_app.exceptions.ResultNotJson"
    assert (run["status"], run["events"]) == ("ERROR", ["exception"])
    assert broker.records.get_result(task.id)["status"] == "FAILED"  # and dead-lettered


def test_link_propagation_links_each_run_to_the_send_span(broker, consumer_process, tmp_path, exporter):
    TaskType.objects.create(name="traced.link", handler="tracing.nested", queue="linked", retry_backoff=0)
    with tracer().start_as_current_span("request"):
        [task] = enqueue("traced.link", kwargs={"fail_attempts": 1})
    send_trace, send_id = _ids(_send_span(exporter, task.id))

    spans = _consume(consumer_process, tmp_path / "spans.jsonl", "--queue", "linked", TASKS_TRACE_PROPAGATION="link")
    runs = _named(spans, "process linked")
    assert [run["attributes"]["tasks_app.task.attempt"] for run in runs] == [1, 2]
    for run in runs:  # each run is the root of a trace of its own, linked to the send
        assert run["parent_id"] is None and run["trace_id"] != send_trace
        assert run["links"] == [{"trace_id": send_trace, "span_id": send_id}]
    assert runs[0]["trace_id"] != runs[1]["trace_id"]
    inside = _named(spans, "inside sync")
    assert [(span["trace_id"], span["parent_id"]) for span in inside] == [(r["trace_id"], r["span_id"]) for r in runs]


def test_a_foreign_envelope_with_a_traceparent_is_processed_in_that_trace(broker: Broker, consumer_process, tmp_path):
    trace_id, parent_id = os.urandom(16).hex(), os.urandom(8).hex()
    task = Task(id="foreign-1", type="tracing.nested", payload=b"{}", queue="foreign")
    task.headers["traceparent"] = f"00-{trace_id}-{parent_id}-01"
    task.headers["baggage"] = "tenant=globex"
    broker.client.lpush(broker.keys.pending("foreign"), encode_task(task))

    spans = _consume(consumer_process, tmp_path / "spans.jsonl", "--queue", "foreign")
    [run] = _named(spans, "process foreign")
    assert (run["trace_id"], run["parent_id"], run["status"]) == (trace_id, parent_id, "UNSET")
    assert run["attributes"]["messaging.message.id"] == "foreign-1"
    [inside] = _named(spans, "inside sync")
    assert (inside["trace_id"], inside["parent_id"], inside["baggage_seen"]) == (trace_id, run["span_id"], "globex")


def test_handler_spans_nest_in_process_mode_and_on_the_asyncio_lane(broker, consumer_process, tmp_path, exporter):
    for name, handler in (("traced.sync", "tracing.nested"), ("traced.async", "tracing.nested_async")):
        TaskType.objects.create(name=name, handler=handler, queue="modes")
    with tracer().start_as_current_span("request") as request:
        enqueue("traced.sync", count=2)
        enqueue("traced.async", count=2)
    trace_id, _ = _ids(request)

    spans = _consume(consumer_process, tmp_path / "spans.jsonl", "--queue", "modes", "--processes", "2")
    runs = {run["span_id"]: run for run in _named(spans, "process modes")}
    assert len(runs) == 4 and {run["trace_id"] for run in runs.values()} == {trace_id}
    for name, task_type in (("inside sync", "traced.sync"), ("inside async", "traced.async")):
        inside = _named(spans, name)
        assert len(inside) == 2
        for span in inside:
            run = runs[span["parent_id"]]
            assert (run["attributes"]["tasks_app.task.type"], span["pid"]) == (task_type, run["pid"])


def test_a_consumer_without_an_sdk_passes_the_trace_context_on_to_the_tasks_its_handler_enqueues(
    broker: Broker, consumer_process
):
    trace_id = os.urandom(16).hex()
    task = Task(id="parent-1", type="tracing.enqueue_child", payload=b"{}", queue="parents")
    task.headers.update({"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01", "baggage": "tenant=initech"})
    broker.client.lpush(broker.keys.pending("parents"), encode_task(task))

    consumer = consumer_process("--burst", "--queue", "parents", TASK_HANDLER_MODULES=MODULES)  # no SPANS_FILE
    assert consumer.wait(120) == 0, consumer.log()
    [raw] = broker.client.lrange(broker.keys.pending("children"), 0, -1)
    headers = decode_task(raw).headers
    assert (headers["traceparent"].split("-")[1], headers["baggage"]) == (trace_id, "tenant=initech")
