"""Logs: one JSON line per task event with its fields, under LOG_FORMAT=json and LOG_LEVEL."""
from __future__ import annotations

import json
import logging
import sys

import pytest

from tasks_app import producer
from tasks_app.logging import JsonFormatter
from tasks_app.models import TaskType

EVENT_FIELDS = {"task_id", "type", "queue", "attempt", "duration_s", "outcome"}


def test_json_formatter_emits_extra_fields_and_exceptions():
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("tasks_app.tasks", logging.WARNING, __file__, 1, "task %s failed", ("t1",),
                                   exc_info=sys.exc_info())
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
        assert EVENT_FIELDS <= set(entry), entry
        assert entry["queue"] == "default" and entry["duration_s"] >= 0
    assert {entry["type"] for entry in events} == {"test.record", "log.flaky"}
    assert next(e for e in events if e["outcome"] == "retried")["level"] == "WARNING"


@pytest.mark.django_db(transaction=True)
def test_log_level_warning_hides_successes(broker, consumer_process):
    producer.enqueue("test.record")
    consumer = consumer_process("--burst", "--lease", "2", LOG_FORMAT="json", LOG_LEVEL="WARNING")
    assert consumer.wait(timeout_s=60) == 0, consumer.log()
    entries = [json.loads(line) for line in consumer.log().splitlines() if line.strip()]
    assert not [entry for entry in entries if entry.get("outcome") == "succeeded"]
    assert all(entry["level"] in {"WARNING", "ERROR", "CRITICAL"} for entry in entries)
