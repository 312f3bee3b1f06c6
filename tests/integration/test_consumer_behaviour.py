"""Retries, dead letters, timeouts, delays, priorities and live settings, with a real consumer."""

import pytest

from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.protocol.codec import decode_task
from tasks_app.protocol.records import ResultRecord
from tests.support.processes import wait_until
from tests.support.recording import marks, recorded_runs

pytestmark = pytest.mark.django_db(transaction=True)


def record_of(broker, task) -> ResultRecord:
    return ResultRecord.from_fields(broker.records.get_result(task.id) or {})


def wait_finished(broker, task, timeout_s: float = 20) -> ResultRecord:
    wait_until(lambda: record_of(broker, task).is_finished, timeout_s, message=f"task {task.id} to finish")
    return record_of(broker, task)


def test_failing_task_is_retried_with_backoff_then_dead_lettered(broker, consumer_in_thread):
    TaskType.objects.create(name="always.fails", handler="demo.fail", max_attempts=3, retry_backoff=0.2)
    with consumer_in_thread():
        [task] = producer.enqueue("always.fails", kwargs={"message": "boom"})
        record = wait_finished(broker, task)
    assert (record.status, record.attempts) == ("FAILED", 3)
    assert [e["exception_class_path"] for e in record.errors] == ["builtins.RuntimeError"] * 3
    assert "boom" in record.errors[-1]["traceback"]
    assert len(record.worker_ids) == 3
    [(raw, _)] = broker.inspect.list_dead("default")
    dead = decode_task(raw)
    assert dead.id == task.id and dead.attempt == 3
    assert "failed 3 of 3 attempts" in dead.dead_reason and "boom" in dead.last_traceback


def test_flaky_task_succeeds_after_k_failures_with_k_plus_one_runs(broker, consumer_in_thread):
    TaskType.objects.create(name="demo.flaky", handler="demo.flaky", max_attempts=5, retry_backoff=0.1)
    with consumer_in_thread():
        [task] = producer.enqueue("demo.flaky", kwargs={"failures": 2})
        record = wait_finished(broker, task)
    assert (record.status, record.attempts, len(record.errors)) == ("SUCCESSFUL", 3, 2)
    assert record.return_value == "succeeded on attempt 3"
    assert broker.inspect.list_dead("default") == []


def test_a_task_past_its_timeout_fails_and_the_consumer_goes_on(broker, consumer_in_thread):
    TaskType.objects.create(name="too.slow", handler="demo.sleep", max_attempts=1, timeout=0.3)
    with consumer_in_thread(concurrency=2):
        [slow] = producer.enqueue("too.slow", [2])
        [quick] = producer.enqueue("demo.echo", [1])
        record = wait_finished(broker, slow, timeout_s=10)
        assert wait_finished(broker, quick).status == "SUCCESSFUL"
    assert record.status == "FAILED"
    assert record.errors[0]["exception_class_path"] == "tasks_app.exceptions.TaskTimeout"
    assert "timeout of 0.3 s" in record.errors[0]["traceback"]


def test_handlers_that_exit_or_return_non_json_fail_without_killing_workers(broker, consumer_in_thread):
    with consumer_in_thread(concurrency=1):
        [exits] = producer.enqueue("test.exit")
        [not_json] = producer.enqueue("test.not_json")
        [after] = producer.enqueue("demo.echo", ["still running"])
        assert wait_finished(broker, after).status == "SUCCESSFUL"
        wait_until(lambda: record_of(broker, exits).attempts == 1 and record_of(broker, not_json).errors, 10)
    assert record_of(broker, exits).errors[0]["exception_class_path"] == "builtins.SystemExit"
    assert record_of(broker, not_json).errors[0]["exception_class_path"] == "tasks_app.exceptions.ResultNotJson"


def test_a_delayed_task_never_runs_before_its_time(broker, consumer_in_thread):
    with consumer_in_thread():
        tasks = producer.enqueue("test.record", delay_s=1.0, count=3)
        for task in tasks:
            wait_finished(broker, task)
    runs = sorted(recorded_runs(broker), key=lambda r: r["task_id"])
    assert [run["task_id"] for run in runs] == sorted(task.id for task in tasks), "each ran once"
    for run, task in zip(runs, sorted(tasks, key=lambda t: t.id), strict=True):
        assert run["start_ms"] >= task.run_after_ms


def test_higher_priority_runs_first_within_a_queue(broker, consumer_in_thread):
    for label, priority in [("low", -10), ("normal", 0), ("high", 10), ("urgent", 100)]:
        producer.enqueue("test.record", kwargs={"label": label}, priority=priority, count=2)
    with consumer_in_thread(concurrency=1, prefetch=0):
        wait_until(lambda: len(recorded_runs(broker)) == 8, 20, message="all eight runs")
    assert [run["label"] for run in recorded_runs(broker)] == [
        "urgent",
        "urgent",
        "high",
        "high",
        "normal",
        "normal",
        "low",
        "low",
    ]


def test_admin_edits_reach_a_running_consumer_within_five_seconds(broker, consumer_in_thread):
    row = TaskType.objects.create(name="tunable", handler="demo.fail", max_attempts=1, retry_backoff=0.1)
    with consumer_in_thread() as consumer:
        wait_until(lambda: consumer.task_types.get("tunable") is not None, 5, message="the type to load")
        row.max_attempts = 2
        row.save()
        wait_until(
            lambda: consumer.task_types.get("tunable").max_attempts == 2, 5, message="the edit to reach the consumer"
        )
        [task] = producer.enqueue("tunable")
        assert wait_finished(broker, task).attempts == 2


def test_disabled_types_wait_without_using_attempts(broker, consumer_in_thread):
    row = TaskType.objects.create(name="pausable", handler="demo.echo")
    [task] = producer.enqueue("pausable")
    row.enabled = False
    row.save()
    with consumer_in_thread():
        wait_until(lambda: broker.inspect.queue_stats("default").delayed == 1, 10, message="the task to be held back")
        assert record_of(broker, task).attempts == 0
        row.enabled = True
        row.save()
        assert wait_finished(broker, task, timeout_s=15).attempts == 1


def test_settings_are_read_from_memory_not_the_database_per_task(broker, django_assert_num_queries):
    from tasks_app.consumer.claiming import Claimed
    from tasks_app.registry import registry
    from tasks_app.task_types import TaskTypeCache
    from tests.support.executing import executor_of

    TaskType.objects.create(name="cached", handler="demo.echo")
    cache = TaskTypeCache()
    cache.refresh()
    broker.leases.heartbeat(["default"], "inline", 10_000, {"lease_ms": 10_000})
    tasks = producer.enqueue("cached", count=5)
    claimed = broker.queue.claim("default", "inline", 5)
    executor = executor_of(broker, registry, "inline", cache)
    with django_assert_num_queries(0):
        for raw in claimed:
            executor.execute(Claimed("default", "inline", raw))
    assert all(record_of(broker, t).status == "SUCCESSFUL" for t in tasks)


def test_tasks_moved_by_a_claim_whose_reply_was_lost_go_back_to_pending(broker):
    from tasks_app.consumer.claiming import Claimed
    from tasks_app.consumer.lifecycle import Consumer
    from tasks_app.consumer.options import ConsumerOptions

    consumer = Consumer(ConsumerOptions(consumer_id="unlucky", lease_s=10), broker=broker)
    consumer.membership.register()
    kept, lost = producer.enqueue("demo.echo", count=2)
    held_raw, lost_raw = broker.queue.claim("default", "unlucky", 2)
    consumer.dispatch([Claimed("default", "unlucky", held_raw)])  # the one whose reply arrived

    consumer.claimer("default").reconcile()

    assert broker.queue.held_by("default", "unlucky") == [held_raw]
    assert broker.client.lrange(broker.keys.pending("default"), 0, -1) == [lost_raw]
    assert {decode_task(held_raw).id, decode_task(lost_raw).id} == {kept.id, lost.id}


def test_the_soft_limit_runs_the_handlers_finally_in_thread_mode(broker, consumer_in_thread):
    TaskType.objects.create(name="steps.slow", handler="test.hang", max_attempts=1, timeout=0.3)
    with consumer_in_thread(concurrency=1):
        [slow] = producer.enqueue("steps.slow", kwargs={"sleep_s": 10, "step_s": 0.05})
        record = wait_finished(broker, slow, timeout_s=10)
    assert record.errors[0]["exception_class_path"] == "tasks_app.exceptions.TaskTimeout"
    assert [m["mark"] for m in marks(broker)] == ["start", "finally"], "interrupted, its finally ran"


def test_a_run_completes_the_record_whether_the_producer_wrote_one_or_not(broker, consumer_in_thread):
    from tasks_app.protocol.codec import Task, encode_arguments, encode_task, payload_of
    from tasks_app.protocol.enqueue import Enqueueable

    payload = payload_of(*encode_arguments([1], {"note": "foreign"}))
    raw = encode_task(Task(id="foreign-1", type="test.record", queue="default", payload=payload))
    broker.enqueuer.enqueue([Enqueueable(queue="default", raw=raw)], result_ttl_s=60)  # no READY record
    [ours] = producer.enqueue("test.record", args=[2], kwargs={"note": "ours"})
    with consumer_in_thread():
        foreign = wait_finished(broker, decode_task(raw))
        record = wait_finished(broker, ours)
    for finished, args, kwargs in ((foreign, [1], {"note": "foreign"}), (record, [2], {"note": "ours"})):
        assert (finished.status, finished.attempts, finished.args, finished.kwargs) == ("SUCCESSFUL", 1, args, kwargs)
        assert finished.type == "test.record" and finished.queue == "default" and finished.started_at


@pytest.mark.parametrize("mode", [[], ["--processes", "1"]], ids=["threads", "processes"])
def test_burst_exits_leaving_a_paused_queues_tasks_and_says_so(broker, consumer_process, mode):
    assert broker.control.pause("paused", by="test")
    waiting = producer.enqueue("test.record", queue="paused", count=2)
    done = producer.enqueue("test.record", count=3)
    later = producer.enqueue("test.record", queue="paused", delay_s=60)
    consumer = consumer_process("--burst", "--queue", "default", "--queue", "paused", "--lease", "2", *mode)
    assert consumer.wait(60) == 0, consumer.log()
    assert {task.id for task in done} == {run["task_id"] for run in recorded_runs(broker)}
    stats = broker.inspect.queue_stats("paused")
    assert (stats.pending, stats.processing, stats.delayed) == (len(waiting), 0, len(later))
    assert "queue paused is paused with 2 task(s) pending and 1 delayed" in consumer.log()
