"""Operator actions racing consumers and each other (record deletes, retries, requeues), against real Redis."""

from __future__ import annotations

import time

import pytest
from django.contrib.admin.models import LogEntry

import tasks_app
from tasks_app import control, producer
from tasks_app.control import CANCELLED
from tasks_app.models import TaskType
from tasks_app.protocol.records import ResultRecord
from tasks_app.web import browser
from tests.support.enqueued import is_idle
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs, runs_per_task

pytestmark = pytest.mark.django_db(transaction=True)


def record_of(broker, task_id: str) -> ResultRecord:
    return ResultRecord.from_fields(broker.records.get_result(task_id) or {})


def told(response) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def test_deleting_the_record_of_a_task_cancelled_in_its_queue_keeps_it_so_it_never_runs(
    broker, staff, consumer_in_thread
):
    waiting = producer.enqueue("test.record")[0].id
    delayed = producer.enqueue("test.record", delay_s=0.5)[0].id
    for task_id in (waiting, delayed):
        assert tasks_app.cancel(task_id).outcome == CANCELLED
    response = staff.post("/tasks/", {"action": "delete", "task": [waiting, delayed]}, follow=True)
    assert told(response) == ["Deleted 0 record(s). 2 not finished (or cancelled, still in their queue), kept."]
    assert not LogEntry.objects.exists()
    with consumer_in_thread():
        wait_until(lambda: is_idle(broker, ["default"]), 15, message="both tasks to be dropped")
        time.sleep(0.3)
    assert runs_per_task(broker) == {}, "a cancelled task ran once its record was deleted"
    assert {record_of(broker, task_id).status for task_id in (waiting, delayed)} == {"CANCELLED"}
    # Dropped by the consumer, out of every queue: now their records go.
    response = staff.post("/tasks/", {"action": "delete", "task": [waiting, delayed]}, follow=True)
    assert told(response) == ["Deleted 2 record(s)."]
    assert broker.records.get_result(waiting) is None and broker.records.get_result(delayed) is None


def test_a_delete_racing_a_requeue_of_the_dead_task_keeps_the_record_of_the_task_requeued(broker, consumer_in_thread):
    TaskType.objects.create(name="test.record", handler="test.record", max_attempts=1)
    task_id = producer.enqueue("test.record", kwargs={"fail_until_attempt": 1})[0].id
    with consumer_in_thread():
        wait_until(lambda: broker.inspect.dead_count("default") == 1, 15, message="the task to be dead-lettered")
    seen = ResultRecord.from_fields(broker.records.get_result(task_id))  # the browser's page: FAILED
    assert seen.status == "FAILED"
    assert (
        len(broker.inspect.requeue_dead_tasks("default", broker.inspect.list_dead_tasks("default")).moved) == 1
    )  # another operator
    _, message = browser.delete(browser.Selection([seen], "user:late"))
    assert message == "Deleted 0 record(s). 1 not finished (or cancelled, still in their queue), kept."
    assert record_of(broker, task_id).status == "READY", "the requeued task lost its record"
    assert task_id in {entry.task_id for entry in broker.records.history_window(["default"], "READY", None, None, 10)}


def test_pause_and_resume_flapping_while_three_consumers_drain_runs_each_task_once(broker, consumer_process):
    TaskType.objects.create(name="test.record", handler="test.record")
    consumers = [consumer_process("--concurrency", "4", "--lease", "2") for _ in range(3)]
    wait_until(
        lambda: len(broker.inspect.queue_stats("default").consumers) == 3, 30, message="the consumers to register"
    )
    ids = [task.id for task in producer.enqueue("test.record", kwargs={"sleep_s": 0.05}, count=300)]
    flapping_ms = broker.inspect.server_time_ms()
    for flip in range(100):
        assert control.set_queue_paused("default", flip % 2 == 0, by="flapper")
        time.sleep(0.01 if flip % 2 == 0 else 0.05)  # paused briefly: tasks claimed before it go back unstarted
    flapped_ms = broker.inspect.server_time_ms()
    assert not broker.control.is_paused("default")
    wait_until(lambda: is_idle(broker, ["default"]), 30, message="every task to end")
    assert runs_per_task(broker) == dict.fromkeys(ids, 1)
    assert {record_of(broker, task_id).status for task_id in ids} == {"SUCCESSFUL"}
    assert any(flapping_ms <= run["start_ms"] <= flapped_ms for run in recorded_runs(broker)), "no run met the flapping"
    assert all(consumer.terminate() == 0 for consumer in consumers)
