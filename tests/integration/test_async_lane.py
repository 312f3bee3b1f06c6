"""The asyncio lane: `async def` handlers share one event loop per consumer, with their own slots."""

import pytest

from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.protocol.records import ResultRecord
from tests.support.processes import wait_until
from tests.support.recording import marks

pytestmark = pytest.mark.django_db(transaction=True)


def record_of(broker, task) -> ResultRecord:
    return ResultRecord.from_fields(broker.records.get_result(task.id) or {})


def test_a_thousand_async_tasks_run_at_once_on_one_process(broker, consumer_process):
    tasks = producer.enqueue("test.async_sleep", kwargs={"sleep_s": 0.05}, count=1000)
    consumer = consumer_process("--burst", "--concurrency", "2", "--prefetch", "2", "--async-concurrency", "200")
    assert consumer.wait(120) == 0, consumer.log()

    fields = [broker.records.get_result(task.id) or {} for task in tasks]
    assert [f.get("status") for f in fields] == ["SUCCESSFUL"] * len(tasks)
    assert max(int(f["return_value"]) for f in fields) > 2, "more at once than there are worker threads"
    first_start = min(float(f["started_at_ms"]) for f in fields)
    last_finish = max(float(f["finished_at_ms"]) for f in fields)
    assert last_finish - first_start < 10_000, "well under the 50 s they would take one after another"


def test_an_async_task_past_its_timeout_is_cancelled_its_finally_runs_and_the_consumer_goes_on(
    broker, consumer_in_thread
):
    TaskType.objects.create(name="async.slow", handler="test.async_hang", timeout=0.3, max_attempts=1)
    with consumer_in_thread(concurrency=1):
        [slow] = producer.enqueue("async.slow", kwargs={"sleep_s": 10})
        [quick] = producer.enqueue("test.async_sleep", kwargs={"sleep_s": 0})
        wait_until(lambda: record_of(broker, slow).is_finished, 10, message="the slow task to time out")
        wait_until(lambda: record_of(broker, quick).is_finished, 10, message="the quick one to finish")
    record = record_of(broker, slow)
    assert (record.status, record.errors[0]["exception_class_path"]) == ("FAILED", "tasks_app.exceptions.TaskTimeout")
    assert "timeout of 0.3 s" in record.errors[0]["traceback"]
    assert [m["mark"] for m in marks(broker)] == ["start", "finally"]
    assert record_of(broker, quick).status == "SUCCESSFUL"


def test_a_failing_async_task_is_retried_through_the_same_path(broker, consumer_in_thread):
    TaskType.objects.create(name="async.fails", handler="test.async_sleep", max_attempts=2, retry_backoff=0.1)
    with consumer_in_thread():
        [task] = producer.enqueue("async.fails", kwargs={"sleep_s": "not a number"})
        wait_until(lambda: record_of(broker, task).is_finished, 10, message="the task to fail twice")
    record = record_of(broker, task)
    assert (record.status, record.attempts) == ("FAILED", 2)
    assert [e["exception_class_path"] for e in record.errors] == ["builtins.ValueError"] * 2
    assert broker.inspect.queue_stats("default").processing == 0


def test_an_async_task_called_with_arguments_its_handler_does_not_take_fails_and_is_retried(broker, consumer_in_thread):
    TaskType.objects.create(name="async.misfit", handler="test.async_sleep", max_attempts=2, retry_backoff=0.1)
    with consumer_in_thread():
        [task] = producer.enqueue("async.misfit", kwargs={"no_such_argument": 1})
        wait_until(lambda: record_of(broker, task).is_finished, 10, message="the task to fail twice")
    record = record_of(broker, task)
    assert (record.status, record.attempts) == ("FAILED", 2), "a failure of the handler, not of settling"
    assert [e["exception_class_path"] for e in record.errors] == ["builtins.TypeError"] * 2
    assert "no_such_argument" in record.errors[0]["traceback"]


def test_a_handler_stopping_the_event_loop_ends_and_every_later_task_still_runs(broker, consumer_in_thread):
    # Before: the lane's loop stayed stopped; its slot never came back, the workers waited for it
    # for good and sync tasks stopped too, while the lease stayed alive.
    with consumer_in_thread(concurrency=1, prefetch=1, async_concurrency=1):
        [stopper] = producer.enqueue("test.async_stops_loop")
        later = producer.enqueue("test.async_sleep", kwargs={"sleep_s": 0}, count=3)
        later += producer.enqueue("test.record")
        tasks = [stopper, *later]
        wait_until(lambda: all(record_of(broker, t).is_finished for t in tasks), 15, message="every task to end")
    assert [record_of(broker, t).status for t in tasks] == ["SUCCESSFUL"] * len(tasks)
    assert record_of(broker, stopper).return_value == "went on"


def test_a_stop_returns_unstarted_the_tasks_waiting_for_room_on_the_lane(broker, consumer_process):
    # Before: a worker waiting for a lane slot when the stop came started its task once the slot
    # was free, after the stop: claimed-but-unstarted tasks must go back to pending instead.
    tasks = producer.enqueue("test.async_hang", kwargs={"sleep_s": 2}, count=5)
    args = ("--consumer-id", "waiting", "--concurrency", "2", "--prefetch", "2", "--async-concurrency", "1")
    consumer = consumer_process(*args, "--grace", "20")
    processing = broker.keys.processing("default", "waiting")
    wait_until(lambda: marks(broker) and broker.client.llen(processing) == 5, 30, message="one run and a full hand")
    assert consumer.terminate(timeout_s=30) == 0, consumer.log()

    started = [m["task_id"] for m in marks(broker) if m["mark"] == "start"]
    assert len(started) == 1, f"only the run begun before the stop: {marks(broker)}"
    statuses = {t.id: record_of(broker, t).status for t in tasks}
    assert statuses == {t.id: "SUCCESSFUL" if t.id in started else "READY" for t in tasks}
    stats = broker.inspect.queue_stats("default")
    assert (stats.pending, stats.processing, stats.consumers) == (4, 0, [])
