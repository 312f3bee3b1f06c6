"""`cancel --force` of running tasks, against real Redis and real `runconsumer` processes.

Process mode replaces the process of a handler stuck in C; thread mode raises TaskCancelled in the
handler's thread (its `finally` runs); an `async def` handler's coroutine is cancelled.
"""

from __future__ import annotations

import time

import pytest

import tasks_app
from tasks_app import producer
from tasks_app.control import REQUESTED
from tasks_app.protocol.records import ResultRecord
from tests.support.process_tree import alive, children_of
from tests.support.processes import wait_until
from tests.support.recording import marks, recorded_runs, runs_per_task

pytestmark = pytest.mark.django_db(transaction=True)


def record_of(broker, task_id: str) -> ResultRecord:
    return ResultRecord.from_fields(broker.records.get_result(task_id) or {})


def test_process_mode_replaces_the_process_of_a_handler_stuck_in_c_and_the_others_run_once(broker, consumer_process):
    group = consumer_process("--processes", "1", "--concurrency", "2", "--prefetch", "2", "--timeout-grace", "1")
    wait_until(lambda: children_of(group.pid), 30, message="the child to start")
    [stuck] = producer.enqueue("test.hang", kwargs={"sleep_s": 30})
    wait_until(lambda: marks(broker), 30, message="the stuck handler to start")
    others = [task.id for task in producer.enqueue("test.record", kwargs={"sleep_s": 1.5}, count=3)]
    wait_until(lambda: recorded_runs(broker), 30, message="another task to run beside it")
    [start] = marks(broker)
    assert recorded_runs(broker)[0]["pid"] == start["pid"], "held by the same process"

    reply = tasks_app.cancel(stuck.id, cancelled_by="tester", force=True)
    assert reply.outcome == REQUESTED
    cancelled_at = time.monotonic()
    wait_until(lambda: record_of(broker, stuck.id).is_finished, 15, message="the stuck task to end")
    assert time.monotonic() - cancelled_at < 10, "stopped long before its 30 s sleep ends"
    record = record_of(broker, stuck.id)
    assert (record.status, record.attempts, record.errors) == ("CANCELLED", 1, [])
    assert record.cancelled_by == "tester"

    wait_until(lambda: not alive(start["pid"]), 30, message="the stuck process to exit")
    assert [m["mark"] for m in marks(broker)] == ["start"], "its end and its finally never reached"
    wait_until(lambda: {record_of(broker, i).status for i in others} == {"SUCCESSFUL"}, 30, message="the others")
    assert runs_per_task(broker) == dict.fromkeys(others, 1), "each of the others ran once"
    assert {record_of(broker, i).attempts for i in others} == {1}, "none was blamed or retried"
    wait_until(lambda: children_of(group.pid) not in ([], [start["pid"]]), 30, message="a replacement child")
    assert group.terminate(timeout_s=60) == 0, group.log()
    assert "after a forced cancel" in group.log() and "exited with status 76; replacing it" in group.log()


@pytest.mark.parametrize(
    ("type_name", "kwargs"),
    [
        ("test.hang", {"sleep_s": 30, "step_s": 0.05}),  # thread mode: TaskCancelled raised in its thread
        ("test.async_hang", {"sleep_s": 30}),  # async: its coroutine is cancelled where it awaits
    ],
)
def test_a_forced_cancel_raises_task_cancelled_in_the_thread_or_coroutine_whose_finally_runs(
    broker, consumer_process, type_name, kwargs
):
    consumer = consumer_process("--concurrency", "2")
    [task] = producer.enqueue(type_name, kwargs=kwargs)
    wait_until(lambda: marks(broker), 30, message="the handler to start")
    assert tasks_app.cancel(task.id, force=True).outcome == REQUESTED
    wait_until(lambda: record_of(broker, task.id).is_finished, 10, message="the run to end")
    record = record_of(broker, task.id)
    assert (record.status, record.attempts, record.errors) == ("CANCELLED", 1, [])
    assert [m["mark"] for m in marks(broker)] == ["start", "finally"]

    [after] = producer.enqueue("test.record")
    wait_until(lambda: record_of(broker, after.id).status == "SUCCESSFUL", 15, message="the consumer to go on")
    assert consumer.terminate() == 0, consumer.log()


def test_a_forced_cancel_of_a_task_not_started_is_a_plain_cancel(broker, consumer_process):
    [task] = producer.enqueue("test.record", delay_s=0.5)
    assert tasks_app.cancel(task.id, force=True).outcome == tasks_app.control.CANCELLED
    consumer = consumer_process("--burst")
    assert consumer.wait(60) == 0, consumer.log()
    assert record_of(broker, task.id).status == "CANCELLED" and runs_per_task(broker) == {}
    assert broker.control.cancel_marks("default", [task.id]) == [0]
