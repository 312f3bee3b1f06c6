"""Enqueue, run with a real consumer, read the results back."""

import pytest

from tasks_app import producer
from tasks_app.protocol.records import ResultRecord
from tests.support.processes import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_burst_consumer_runs_every_task_and_records_results(broker, consumer_process):
    enqueued = producer.enqueue("demo.echo", [1, "two"], {"three": 3}, count=50)

    consumer = consumer_process("--burst", "--lease", "2", "--concurrency", "4")
    assert consumer.wait(timeout_s=60) == 0, consumer.log()

    for task in enqueued:
        record = ResultRecord.from_fields(broker.records.get_result(task.id))
        assert record.status == "SUCCESSFUL"
        assert record.return_value == {"args": [1, "two"], "kwargs": {"three": 3}}
        assert record.attempts == 1
        assert record.started_at and record.finished_at and record.enqueued_at
        assert len(record.worker_ids) == 1
    stats = broker.inspect.queue_stats("default")
    assert (stats.pending, stats.processing, stats.delayed, stats.dead) == (0, 0, 0, 0)


def test_consumer_in_thread_runs_tasks(broker, consumer_in_thread):
    with consumer_in_thread(concurrency=2):
        enqueued = producer.enqueue("demo.echo", [7])
        wait_until(
            lambda: (broker.records.get_result(enqueued[0].id) or {}).get("status") == "SUCCESSFUL",
            10,
            message="the task to succeed",
        )
