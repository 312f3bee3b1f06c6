"""Keyed rate limits and pausing a queue, across real consumer processes on real Redis."""

from __future__ import annotations

import time

import pytest

import tasks_app
from tasks_app import producer
from tasks_app.control import CANCELLED
from tasks_app.models import TaskType
from tests.support.processes import wait_until
from tests.support.recording import most_starts_in_any_window, recorded_runs, remove_limit_and_wait_for_runs

pytestmark = pytest.mark.django_db(transaction=True)

RECORD = "test.record"


@pytest.mark.alone  # its start times are read at the handler's first line: load elsewhere would shift them
def test_keyed_rate_limit_runs_tenants_side_by_side(broker, consumer_process):
    TaskType.objects.create(name=RECORD, handler=RECORD, rate_limit=3, rate_period=1.0, rate_limit_key="tenant")
    consumers = [consumer_process("--concurrency", "4", "--lease", "2") for _ in range(2)]
    wait_until(
        lambda: len(broker.inspect.queue_stats("default").consumers) == 2, 30, message="two consumers to register"
    )

    flood = producer.enqueue(RECORD, kwargs={"tenant": "a"}, count=9)  # tenant a floods first
    other = producer.enqueue(RECORD, kwargs={"tenant": "b"}, count=9)
    wait_until(lambda: len(recorded_runs(broker)) >= 18, 30, interval_s=0.2, message="all 18 tasks to start")

    runs = recorded_runs(broker)
    assert sorted(run["task_id"] for run in runs) == sorted(task.id for task in flood + other)
    starts = {tenant: [run["start_ms"] for run in runs if run["tenant"] == tenant] for tenant in "ab"}
    for tenant, times in starts.items():
        assert most_starts_in_any_window(times, 1000) <= 3, tenant
        assert max(times) - min(times) <= 4200, (tenant, [c.log() for c in consumers])  # ~2.8 s for 9 at 3/s
    assert abs(min(starts["a"]) - min(starts["b"])) <= 1000  # b did not wait behind a's deferred tasks
    assert max(max(t) for t in starts.values()) - min(min(t) for t in starts.values()) <= 5000  # not ~6 s


def test_a_removed_keyed_limit_runs_the_deferred_tasks_of_every_value_at_once(broker, consumer_process):
    row = TaskType.objects.create(name=RECORD, handler=RECORD, rate_limit=1, rate_period=60, rate_limit_key="tenant")
    consumer_process("--concurrency", "2", "--lease", "2")
    waiting = [*producer.enqueue(RECORD, kwargs={"tenant": "a"}, count=3)]
    waiting += producer.enqueue(RECORD, kwargs={"tenant": "b"}, count=3)
    wait_until(
        lambda: broker.inspect.queue_stats("default").delayed == 4, 15, message="two tasks of each tenant to wait"
    )

    remove_limit_and_wait_for_runs(
        broker, row, waiting, "every waiting task to run once the limit is gone, not a minute apart"
    )


def test_paused_queue_starts_nothing_and_resuming_starts_at_once(broker, consumer_process):
    TaskType.objects.create(name=RECORD, handler=RECORD)
    consumer_process("--concurrency", "4", "--lease", "2")
    wait_until(lambda: broker.inspect.queue_stats("default").consumers, 30, message="the consumer to register")
    time.sleep(0.5)  # idle: its claim is blocked on the empty pending list

    assert broker.control.pause("default", by="test")
    consumer_process("--concurrency", "4", "--lease", "2")  # a consumer started meanwhile obeys it too
    time.sleep(1.0)  # consumers stop claiming within 1 s
    enqueued = producer.enqueue(RECORD, count=10)  # enqueues are still accepted
    enqueued_at = time.monotonic()
    wait_until(
        lambda: len(broker.inspect.queue_stats("default").consumers) == 2, 30, message="the second consumer to register"
    )
    time.sleep(max(1.0, enqueued_at + 3.0 - time.monotonic()))  # 3 s at least, 1 s of them with both
    stats = broker.inspect.queue_stats("default")
    assert recorded_runs(broker) == []
    assert (stats.paused, stats.pending, stats.processing, len(stats.consumers)) == (True, 10, 0, 2)

    resumed_ms = broker.inspect.server_time_ms()
    assert broker.control.resume("default")
    wait_until(lambda: len(recorded_runs(broker)) == 10, 10, message="every task to start after the resume")
    runs = recorded_runs(broker)
    assert sorted(run["task_id"] for run in runs) == sorted(task.id for task in enqueued)
    assert min(run["start_ms"] for run in runs) - resumed_ms <= 1000
    assert not broker.inspect.queue_stats("default").paused


def test_a_cancel_of_a_task_sent_back_by_a_pause_cancels_it_at_once(broker, consumer_in_thread):
    TaskType.objects.create(name=RECORD, handler=RECORD)
    with consumer_in_thread(concurrency=1, prefetch=3):
        first, *prefetched = producer.enqueue(RECORD, kwargs={"sleep_s": 1.0}, count=4)
        wait_until(lambda: recorded_runs(broker), 10, message="the first task to start")
        assert broker.control.pause("default", by="test")  # the other three, prefetched meanwhile, go back unstarted
        wait_until(
            lambda: broker.inspect.queue_stats("default").pending == 3, 10, message="the prefetched tasks to go back"
        )
        wait_until(
            lambda: all(not broker.records.get_result(task.id).get("claimed_fence") for task in prefetched),
            10,
            message="their receipts to be withdrawn",
        )
        replies = tasks_app.cancel_many([task.id for task in prefetched])
        # Not "requested" (a consumer asked to stop a task it no longer holds): cancelled, and read so.
        assert [reply.outcome for reply in replies] == [CANCELLED] * 3
        assert {broker.records.get_result(task.id)["status"] for task in prefetched} == {"CANCELLED"}
        assert broker.control.resume("default")
        wait_until(
            lambda: broker.inspect.queue_stats("default").pending == 0, 10, message="the cancelled tasks to be dropped"
        )
        wait_until(
            lambda: broker.records.get_result(first.id)["status"] == "SUCCESSFUL", 10, message="the first to end"
        )
    assert [run["task_id"] for run in recorded_runs(broker)] == [first.id]


def test_a_cancel_of_a_task_a_stopping_consumer_sent_back_cancels_it_at_once(broker, consumer_in_thread):
    TaskType.objects.create(name=RECORD, handler=RECORD)
    with consumer_in_thread(concurrency=1, prefetch=3):
        first, *prefetched = producer.enqueue(RECORD, kwargs={"sleep_s": 1.0}, count=4)
        wait_until(lambda: recorded_runs(broker), 10, message="the first task to start")
        wait_until(
            lambda: all(broker.records.get_result(task.id).get("claimed_fence") for task in prefetched),
            10,
            message="the other three to be prefetched",
        )
    # Stopped: the first finished within the grace period, the other three went back unstarted.
    assert broker.records.get_result(first.id)["status"] == "SUCCESSFUL"
    assert broker.inspect.queue_stats("default").pending == 3
    assert all(not broker.records.get_result(task.id).get("claimed_fence") for task in prefetched), (
        "receipts left standing"
    )
    replies = tasks_app.cancel_many([task.id for task in prefetched])
    assert [reply.outcome for reply in replies] == [CANCELLED] * 3
    assert {broker.records.get_result(task.id)["status"] for task in prefetched} == {"CANCELLED"}
