"""A consumer's graceful stop: its grace period, and the runs still going when it ends."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from tasks_app import producer
from tasks_app.consumer.lifecycle import Consumer
from tasks_app.consumer.options import ConsumerOptions
from tasks_app.models import TaskType
from tasks_app.protocol.records import ResultRecord
from tests.support.consumers import running
from tests.support.processes import wait_until
from tests.support.recording import marks, recorded_runs
from tests.test_consumer import make_consumer

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_grace_period_counts_from_the_stop_even_while_a_claimer_is_slow_to_stop(broker, caplog):
    # Before: the stop waited for its claimers (up to block_s + 1 s each) and only then began
    # the grace period: a stop took that much longer than --grace.
    consumer = make_consumer(broker, grace_s=0.3, block_s=30)
    claimer_may_stop = threading.Event()
    slow_claimer = threading.Thread(target=claimer_may_stop.wait, args=(30,), daemon=True)
    slow_claimer.start()
    consumer._claimers = [slow_claimer]
    consumer._busy = 1  # a run that does not end
    stopping = threading.Thread(target=consumer.shutdown, daemon=True)
    stopping.start()
    try:
        wait_until(lambda: "grace period over" in caplog.text, 10, message="the grace period to end")
        assert stopping.is_alive(), "it still waits for its claimer before it leaves"
    finally:
        claimer_may_stop.set()
    stopping.join(10)
    assert not stopping.is_alive() and broker.inspect.queue_stats("q").consumers == []


def record_of(broker, task) -> ResultRecord:
    return ResultRecord.from_fields(broker.records.get_result(task.id) or {})


def due_now(broker, queue: str = "default") -> None:
    """Make every delayed task of `queue` due now (a retry of an interrupted run waits for its process to be gone)."""
    members = broker.client.zrange(broker.keys.delayed(queue), 0, -1)
    assert members, "nothing waits in delayed"
    broker.limits.bring_forward(queue, dict.fromkeys(members, 0))


def test_a_run_outliving_every_grace_period_uses_an_attempt_at_each_stop_until_dead_lettered(
    broker, consumer_in_thread
):
    # Before: it went back to pending at each stop with its attempt unused, to run and be cut
    # off again at the next one: over restarts it looped for good.
    TaskType.objects.create(name="outlives.grace", handler="test.record", max_attempts=2)
    [task] = producer.enqueue("outlives.grace", kwargs={"hold_until": "release"})
    try:
        for run in (1, 2):
            with consumer_in_thread(grace_s=0.2):
                wait_until(lambda run=run: len(recorded_runs(broker)) == run, 15, message=f"run {run} to start")
            stats = broker.inspect.queue_stats("default")
            assert (stats.pending, stats.processing) == (0, 0)
            if run == 1:
                assert (stats.delayed, record_of(broker, task).status) == (1, "READY"), "retried"
                due_now(broker)
    finally:
        broker.client.set(f"{broker.keys.prefix}:release", 1)  # the runs given up on end here
    record = record_of(broker, task)
    assert (record.status, record.attempts) == ("FAILED", 2)
    assert [e["exception_class_path"] for e in record.errors] == ["tasks_app.exceptions.TaskInterrupted"] * 2
    assert "0.2 s after the stop" in record.errors[0]["traceback"]
    assert broker.inspect.queue_stats("default").dead == 1


def test_an_async_run_outliving_the_grace_period_is_interrupted_too(broker, consumer_in_thread):
    TaskType.objects.create(name="async.outlives", handler="test.async_hang", max_attempts=1)
    [task] = producer.enqueue("async.outlives", kwargs={"sleep_s": 60})
    with consumer_in_thread(grace_s=0.2):
        wait_until(lambda: marks(broker), 15, message="the run to start")
    record = record_of(broker, task)
    assert (record.status, record.attempts) == ("FAILED", 1)
    assert record.errors[0]["exception_class_path"] == "tasks_app.exceptions.TaskInterrupted"
    stats = broker.inspect.queue_stats("default")
    assert (stats.pending, stats.processing, stats.dead) == (0, 0, 1)


def _late(answer: Callable[..., Any], asked: threading.Event, may_answer: threading.Event) -> Callable[..., Any]:
    """`answer`, whose reply comes only once the test lets it (a round trip that outlasts the grace period)."""

    def late(*args: Any) -> Any:
        asked.set()
        may_answer.wait(30)
        return answer(*args)

    return late


@pytest.mark.parametrize("gate", ["rate_limit", "max_running", "lease_check"])
def test_a_task_whose_gate_answers_after_the_grace_period_never_starts_and_goes_back_unstarted(broker, caplog, gate):
    TaskType.objects.create(name="gated", handler="test.record", rate_limit=100, max_running=5)
    [task] = producer.enqueue("gated")
    asked, may_answer = threading.Event(), threading.Event()
    consumer = Consumer(ConsumerOptions(lease_s=2.0, grace_s=0.2, block_s=0.5), broker=broker)
    if gate == "rate_limit":
        consumer.executor.rate_gate = _late(consumer.executor.rate_gate, asked, may_answer)
    elif gate == "max_running":
        slots = consumer.executor.concurrency
        slots.acquire = _late(slots.acquire, asked, may_answer)  # type: ignore[method-assign]
    else:  # the last check before its start is written: it passed the first look at the grace period
        consumer.executor.lease_check = _late(consumer._lease_holds, asked, may_answer)
    try:
        with running(consumer):
            wait_until(asked.is_set, 15, message="the worker to wait for its gate's answer")
            consumer.request_stop()
            wait_until(lambda: "grace period over" in caplog.text, 10, message="the grace period to end")
            may_answer.set()  # before: the run started now, past the grace period, in a process about to exit
            wait_until(lambda: consumer._busy == 0, 10, message="the worker to be done with the task")
    finally:
        may_answer.set()
    assert recorded_runs(broker) == [], "it never started"
    stats = broker.inspect.queue_stats("default")
    assert (stats.pending, stats.processing, stats.delayed) == (1, 0, 0), "back unstarted"
    if gate != "lease_check":  # met before its start was written (after, its record may say RUNNING until rerun)
        assert record_of(broker, task).status == "READY"
