"""Logs: one JSON line per task event with its fields (LOG_FORMAT=json), one escaped line per record (text)."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from tasks_app import producer
from tasks_app.logging import CONTINUATION_INDENT, ConsoleHandler, JsonFormatter, TextFormatter, held_lines
from tasks_app.models import TaskType
from tasks_app.protocol.codec import Task, encode_arguments, encode_task, payload_of

EVENT_FIELDS = {"task_id", "type", "queue", "attempt", "duration_s", "outcome"}


def test_json_formatter_emits_extra_fields_and_exceptions():
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord(
            "tasks_app.tasks", logging.WARNING, __file__, 1, "task %s failed", ("t1",), exc_info=sys.exc_info()
        )
    record.task_id, record.outcome = "t1", "retried"
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "task t1 failed" and entry["level"] == "WARNING"
    assert entry["task_id"] == "t1" and entry["outcome"] == "retried"
    assert "ValueError: boom" in entry["exception"]


@pytest.mark.django_db(transaction=True)
def test_consumer_logs_one_json_line_per_task_event(broker, consumer_process):
    TaskType.objects.create(name="log.flaky", handler="test.record", max_attempts=2, retry_backoff=0.05)
    [ok] = producer.enqueue("test.record")
    [flaky] = producer.enqueue("log.flaky", kwargs={"fail_until_attempt": 1})

    consumer = consumer_process("--burst", "--lease", "2", LOG_FORMAT="json", LOG_LEVEL="INFO")
    assert consumer.wait(timeout_s=60) == 0, consumer.log()

    lines = [line for line in consumer.log().splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]  # every line is JSON
    events = [entry for entry in entries if entry.get("outcome")]
    outcomes = sorted((entry["task_id"], entry["outcome"], entry["attempt"]) for entry in events)
    assert outcomes == sorted([(ok.id, "succeeded", 1), (flaky.id, "retried", 1), (flaky.id, "succeeded", 2)])
    for entry in events:
        assert set(entry) >= EVENT_FIELDS, entry
        assert entry["queue"] == "default" and entry["duration_s"] >= 0
    assert {entry["type"] for entry in events} == {"test.record", "log.flaky"}
    assert next(e for e in events if e["outcome"] == "retried")["level"] == "WARNING"


@pytest.mark.django_db(transaction=True)
def test_log_level_warning_hides_successes(broker, consumer_process):
    TaskType.objects.create(name="log.flaky", handler="test.record", max_attempts=2, retry_backoff=0.05)
    [ok] = producer.enqueue("test.record")
    [flaky] = producer.enqueue("log.flaky", kwargs={"fail_until_attempt": 1})
    consumer = consumer_process("--burst", "--lease", "2", LOG_FORMAT="json", LOG_LEVEL="WARNING")
    assert consumer.wait(timeout_s=60) == 0, consumer.log()
    assert broker.records.get_result(ok.id)["status"] == "SUCCESSFUL"
    assert broker.records.get_result(flaky.id)["status"] == "SUCCESSFUL"
    entries = [json.loads(line) for line in consumer.log().splitlines() if line.strip()]
    # The retry is logged at WARNING, so the consumer did log at this level; its successes are not.
    events = [(entry["task_id"], entry["outcome"]) for entry in entries if entry.get("outcome")]
    assert events == [(flaky.id, "retried")], entries
    assert all(entry["level"] in {"WARNING", "ERROR", "CRITICAL"} for entry in entries)


@pytest.mark.django_db(transaction=True)
def test_text_log_keeps_a_foreign_task_id_with_a_newline_on_one_line(broker, consumer_process):
    forged = "2026-01-01 00:00:00,000 INFO tasks_app.consumer everything is fine"
    task = Task(
        id=f"evil\n{forged}\r\x1b[2J",
        type="no.such.type",
        queue="default",
        payload=payload_of(*encode_arguments([], {})),
    )
    broker.client.lpush(broker.keys.pending("default"), encode_task(task))
    broker.client.sadd(broker.keys.queues(), "default")

    consumer = consumer_process("--burst", "--lease", "2", LOG_FORMAT="text", LOG_LEVEL="INFO")
    assert consumer.wait(timeout_s=60) == 0, consumer.log()

    lines = consumer.log().splitlines()
    [dead_line] = [line for line in lines if "dead-lettered" in line]
    assert "evil\\n2026-01-01" in dead_line and "\\r\\x1b[2J" in dead_line
    assert not [line for line in lines if line.startswith(forged)]
    assert "\x1b" not in consumer.log()


def test_text_formatter_indents_tracebacks_and_escapes_their_lines():
    formatter = TextFormatter("%(levelname)s %(message)s")
    try:
        raise ValueError("first\nINFO forged record")
    except ValueError:
        record = logging.LogRecord(
            "tasks_app.tasks", logging.ERROR, __file__, 1, "task %s failed", ("t\u20281",), exc_info=sys.exc_info()
        )
    head, *rest = formatter.format(record).split("\n")
    assert head == "ERROR task t\\u20281 failed"
    assert rest and all(line.startswith(CONTINUATION_INDENT) for line in rest)
    assert rest[-1] == CONTINUATION_INDENT + "INFO forged record"


def test_the_text_formatters_time_is_what_logging_writes_for_every_second_and_millisecond():
    ours, standard = TextFormatter("%(asctime)s %(message)s"), logging.Formatter("%(asctime)s %(message)s")
    for created in (1_765_000_000.0, 1_765_000_000.999, 1_765_000_001.5, 1_765_000_000.25, 1_765_003_600.0):
        record = logging.LogRecord("x", logging.INFO, "", 0, "m", (), None)
        record.created, record.msecs = created, (created - int(created)) * 1000
        assert ours.formatTime(record) == standard.formatTime(record)
        assert ours.formatTime(record, "%H:%M") == standard.formatTime(record, "%H:%M")


def test_lines_a_thread_holds_go_out_in_one_write_after_the_block():
    class Stream:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> None:
            self.writes.append(text)

        def flush(self) -> None:
            pass

    stream = Stream()
    handler = ConsoleHandler(stream)
    handler.setFormatter(TextFormatter("%(message)s"))
    log = logging.getLogger("tests.held_lines")
    log.addHandler(handler)
    log.propagate = False
    try:
        with held_lines():
            log.warning("one\nline")
            log.warning("two")
            assert stream.writes == []
        log.warning("three")
    finally:
        log.removeHandler(handler)
    assert stream.writes == ["one\\nline\ntwo\n", "three\n"]
