"""Send spans of the producer, one per call and queue, with their context in every envelope; the module without
the API."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from django.db import transaction
from opentelemetry.trace import SpanKind, StatusCode
from redis.exceptions import ConnectionError as RedisConnectionError

from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.periodic.config import PeriodicConfig
from tasks_app.periodic.firing import fire_slot, run_id
from tasks_app.periodic.schedule import Schedule
from tasks_app.producer import QueueUnavailable, TaskRequest
from tasks_app.protocol.codec import decode_task
from tasks_app.protocol.periodic import SlotFiring
from tests.support import django_tasks
from tests.support.span_export import in_memory, tracer
from tests.test_dead_letter_views import dead_url, make_dead

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def exporter():
    """The queue's spans of this test, in memory."""
    with in_memory() as spans:
        yield spans


def _pending_headers(broker, queue: str) -> list[dict[str, str]]:
    return [dict(decode_task(raw).headers) for raw in broker.client.lrange(broker.keys.pending(queue), 0, -1)]


def _traceparent(span) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def test_a_batch_makes_one_send_span_per_queue_and_every_task_carries_its_context(broker, exporter, echo_type):
    TaskType.objects.create(name="mail.send", handler="demo.echo", queue="mail")
    requests = [TaskRequest("web.echo", [n]) for n in range(3)] + [TaskRequest("mail.send", ["x"], headers={"a": "b"})]
    with tracer().start_as_current_span("job") as parent:
        enqueued = producer.enqueue_many(requests)
    sends = {span.name: span for span in exporter.get_finished_spans() if span.kind == SpanKind.PRODUCER}
    assert sorted(sends) == ["send mail", "send web"]
    web, mail = sends["send web"], sends["send mail"]
    for span in (web, mail):
        assert span.parent.span_id == parent.get_span_context().span_id
        assert span.attributes["messaging.system"] == "tasks_app"
    assert web.attributes["messaging.batch.message_count"] == 3 and "messaging.message.id" not in web.attributes
    assert mail.attributes["messaging.message.id"] == enqueued[3].id
    assert "messaging.batch.message_count" not in mail.attributes
    assert [h["traceparent"] for h in _pending_headers(broker, "web")] == [_traceparent(web)] * 3
    assert _pending_headers(broker, "mail") == [{"a": "b", "traceparent": _traceparent(mail)}]


def test_a_push_redis_refuses_ends_its_send_span_in_error(broker, exporter, echo_type, monkeypatch):
    def refuse(*args, **kwargs):
        raise RedisConnectionError("gone")

    monkeypatch.setattr(broker.enqueuer, "enqueue", refuse)
    with pytest.raises(QueueUnavailable):
        producer.enqueue("web.echo", [1], broker=broker)
    [send] = exporter.get_finished_spans()
    assert (send.name, send.status.status_code, send.attributes["error.type"]) == (
        "send web",
        StatusCode.ERROR,
        "redis.exceptions.ConnectionError",
    )


def test_a_requeued_dead_letter_carries_the_requeue_requests_trace(staff, broker, exporter, echo_type):
    with tracer().start_as_current_span("first request"):
        task = make_dead(broker)
    exporter.clear()
    [dead] = broker.inspect.list_dead_tasks("web")
    assert "traceparent" in dead.task.headers
    with tracer().start_as_current_span("requeue request") as requeue:
        assert staff.post(dead_url(), {"requeue_one": dead.ref}).status_code == 302
    [send] = [span for span in exporter.get_finished_spans() if span.kind == SpanKind.PRODUCER]
    assert (send.name, send.parent.span_id) == ("send web", requeue.get_span_context().span_id)
    assert send.attributes["messaging.message.id"] == task.id
    assert _pending_headers(broker, "web") == [{"traceparent": _traceparent(send)}]


def test_without_the_api_nothing_is_traced_and_headers_are_left_alone():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["opentelemetry"] = None  # as if the `otel` extra were not installed
        from tasks_app import tracing
        headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
        sends = tracing.Sends()
        sends.stamp("q", headers)
        sends.end([("q", "id")])
        tracing.restamp(headers, sends, "q")
        run = tracing.start_run(headers, "id", "t", "q", 1, "c", False)
        with tracing.current(run):
            pass
        tracing.end_run(run, tracing.SUCCEEDED, None)
        tracing.flush()
        print(tracing.INSTALLED, run, headers)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        "False",
        "None",
        "{'traceparent':",
        "'00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'}",
    ]


def test_a_batch_refused_midway_ends_its_send_spans_in_error_having_sent_nothing(broker, exporter, echo_type):
    with pytest.raises(producer.EnqueueError):
        producer.enqueue_many([TaskRequest("web.echo", [1]), TaskRequest("no.such.type")])
    [send] = exporter.get_finished_spans()
    assert (send.name, send.status.status_code, send.attributes["messaging.batch.message_count"]) == (
        "send web",
        StatusCode.ERROR,
        0,
    )
    assert broker.inspect.queue_stats("web").pending == 0


def test_a_fired_periodic_slot_sends_one_root_span_and_a_lost_race_sends_nothing(broker, exporter):
    TaskType.objects.create(name="demo.echo", handler="demo.echo", queue="ticks")
    config = PeriodicConfig(name="every.second", task_type="demo.echo", schedule=Schedule(interval_s=1), args=[1])
    seconds, _ = broker.client.time()
    slot = SlotFiring(seconds * 1000, seconds * 1000 - 1000, 60_000, "skip")
    assert fire_slot(config, slot, broker).outcome == "fired"
    assert fire_slot(config, slot, broker).outcome == "done"  # another consumer's turn at the same slot
    fired, lost = exporter.get_finished_spans()
    [run] = _pending_headers(broker, "ticks")
    assert (fired.name, fired.parent, run["traceparent"]) == ("send ticks", None, _traceparent(fired))
    assert fired.attributes["messaging.message.id"] == run_id("every.second", seconds * 1000)
    assert lost.attributes["messaging.batch.message_count"] == 0


@pytest.mark.django_db(transaction=True)
def test_a_django_task_enqueued_in_a_transaction_is_sent_when_it_commits(settings, broker, exporter):
    settings.TASKS = {"default": {"BACKEND": "tasks_app.backends.RedisBackend", "QUEUES": []}}
    with tracer().start_as_current_span("view") as view, transaction.atomic():
        result = django_tasks.add.enqueue(1, 2)
        assert [span.name for span in exporter.get_finished_spans()] == []  # nothing sent before the commit
    [send] = [span for span in exporter.get_finished_spans() if span.kind == SpanKind.PRODUCER]
    assert (send.name, send.parent.span_id) == ("send default", view.get_span_context().span_id)
    assert send.attributes["messaging.message.id"] == result.id
    assert [headers["traceparent"] for headers in _pending_headers(broker, "default")] == [_traceparent(send)]


@pytest.mark.django_db(transaction=True)
def test_a_django_task_whose_transaction_rolls_back_ends_its_send_span_having_sent_nothing(settings, broker, exporter):
    settings.TASKS = {"default": {"BACKEND": "tasks_app.backends.RedisBackend", "QUEUES": []}}
    with tracer().start_as_current_span("view"), transaction.atomic():
        django_tasks.add.enqueue(1, 2)
        transaction.set_rollback(True)  # as a view that failed
    [send] = [span for span in exporter.get_finished_spans() if span.kind == SpanKind.PRODUCER]
    assert (send.name, send.attributes["messaging.batch.message_count"]) == ("send default", 0)
    assert _pending_headers(broker, "default") == []
