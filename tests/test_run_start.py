"""Whether a claimed task may start: its consumer's lease, its receipt, a later claim, a cancel racing its start."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tasks_app import metrics
from tasks_app.consumer.ack_batcher import AckBatcher
from tasks_app.consumer.async_lane import AsyncLane
from tasks_app.consumer.claiming import Claimed
from tasks_app.consumer.lifecycle import Consumer
from tasks_app.consumer.options import ConsumerOptions
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker
from tasks_app.registry import Handler, Registry, registry as default_registry
from tasks_app.task_types import TaskTypeCache
from tests.support.claims import claim, push, register, task_bytes
from tests.support.executing import NoWorkerSlots, executor_of
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs

pytestmark = pytest.mark.django_db(transaction=True)


def _consumer(broker: Broker) -> Consumer:
    options = ConsumerOptions(
        queues=["q"], concurrency=1, prefetch=0, lease_s=2.0, grace_s=0.2, block_s=0.1, consumer_id="me"
    )
    consumer = Consumer(options, broker=broker)
    consumer.membership.register()
    consumer.task_types.refresh()  # as start() does: claimers wait until the task types were read
    return consumer


def _claim_through_the_claimer(consumer: Consumer) -> Claimed:
    consumer.claimer("q").run_once()
    return consumer.work.get_nowait()


def test_a_task_does_not_start_under_a_stale_lease_while_the_consumer_stops(broker):
    consumer = _consumer(broker)
    try:
        push(broker, task_bytes("t1"))
        [raw] = claim(broker, "me", 1)
        # The last renewal is older than lease - lease/6: this consumer may be presumed dead.
        consumer.lease._renewal = ("me", time.monotonic() - 10)
        consumer.claiming_stopped.set()  # SIGTERM arrived while the task passed its gates
        consumer.executor.execute(Claimed("q", "me", raw, fence=1))
        assert recorded_runs(broker) == [], "started although its lease may have lapsed"
        assert broker.queue.held_by("q", "me") == [raw]  # still held: deregistering (or the reaper) returns it
    finally:
        consumer.give_up.set()


def test_a_foreign_task_claimed_a_second_time_still_gets_a_full_record(broker):
    # A foreign producer pushed the task without a READY record (PROTOCOL.md: optional).
    consumer = _consumer(broker)
    try:
        push(broker, task_bytes("t3", payload=b'{"kwargs": {"tag": "x"}}'))
        first = _claim_through_the_claimer(consumer)
        assert first.receipt == 3  # the receipt created the record: {claimed_fence, fence} only
        # It goes back unstarted (its queue was paused, its consumer stopped, a rate limit deferred it...).
        broker.queue.return_unstarted("q", "me", [first.raw])
        consumer.held.finished([first])
        second = _claim_through_the_claimer(consumer)
        assert second.receipt == 3  # the record still holds none of the task's fields
        consumer.executor.execute(second)
        while consumer.acks.flush_once(block_s=0):
            pass
        record = broker.records.get_result("t3")
        assert record["status"] == "SUCCESSFUL"
        assert (record["type"], record["queue"], record["kwargs"]) == ("test.record", "q", '{"tag":"x"}')
    finally:
        consumer.give_up.set()


@pytest.mark.parametrize("receipt", [None, 0])
def test_a_run_whose_start_a_later_claim_turned_away_does_not_start(broker, receipt):
    # receipt None: the worker waits for its RUNNING write, which Redis ignores (reply 0) because
    # a later claim's token is on the record; receipt 0: claim_receipts said the same up front.
    register(broker, "me", lease_ms=30_000)
    push(broker, task_bytes("t6"))
    [raw] = claim(broker, "me", 1)
    later = broker.queue.issue_fence("q") + 1000  # meanwhile the task was claimed again (pushed twice, or reaped)
    assert broker.queue.claim_receipts([("t6", later)], 60) == [3]
    batcher = AckBatcher(broker, threading.Event())
    executor = executor_of(broker, default_registry, "me", acks=batcher)
    executor.execute(Claimed("q", "me", raw, fence=later - 1000, receipt=receipt))
    while batcher.flush_once(block_s=0):
        pass
    assert recorded_runs(broker) == [], "ran although a later claim holds the task"
    assert broker.records.get_result("t6")["fence"] == str(later)
    assert broker.queue.held_by("q", "me") == []  # acked unrun: the later claim runs it


def test_a_lease_lost_while_the_start_was_written_leaves_the_task_to_the_reaper_unrun(broker):
    register(broker, "me", lease_ms=30_000)
    push(broker, task_bytes("t7"))
    [raw] = claim(broker, "me", 1)
    # Held at the gates; lapsed while the RUNNING write waited for Redis (or the process was stopped).
    answers = iter([True, False])
    executor = executor_of(broker, default_registry, "me", lease_check=lambda item: next(answers))
    assert executor.execute(Claimed("q", "me", raw, fence=1)) is False
    assert recorded_runs(broker) == [], "started after its lease was lost"
    assert broker.queue.held_by("q", "me") == [raw]  # the reaper hands it on


def test_a_suspect_whose_lease_lapsed_during_its_start_is_neither_run_nor_blamed(broker):
    register(broker, "me", lease_ms=30_000)
    push(broker, task_bytes("t8"))
    [raw] = claim(broker, "me", 1)
    # The consumer's own clock still says held; on Redis's clock the lease has lapsed (the reaper's test).
    broker.client.zadd(broker.keys.consumers("q"), {"me": 0})
    executor = executor_of(broker, default_registry, "me", lease_check=lambda _: True)
    assert executor.execute(Claimed("q", "me", raw, suspect=True, fence=1)) is False
    assert recorded_runs(broker) == [], "started after its lease lapsed"
    marks = broker.client.hkeys(broker.keys.recoveries("q"))
    assert not [mark for mark in marks if mark.startswith(b"s:")], "marked as started: the reaper would blame it"
    assert broker.queue.held_by("q", "me") == [raw]


def test_an_async_run_waiting_for_a_full_lane_does_not_start_once_its_lease_is_lost(broker):
    started, lane_free, lease = [], threading.Event(), {"held": True}

    async def holds_the_lane(name: str) -> None:
        started.append(name)
        while not lane_free.is_set():
            await asyncio.sleep(0.01)

    registry = Registry()
    registry.add(Handler("x.async", holds_the_lane))
    register(broker, "me", lease_ms=30_000)
    lane = AsyncLane(1, NoWorkerSlots())
    executor = executor_of(broker, registry, "me", async_lane=lane, lease_check=lambda _: lease["held"])
    for name in ("t1", "t2"):
        push(broker, task_bytes(name, "x.async", payload=f'{{"args": ["{name}"]}}'.encode()))
    first, second = (Claimed("q", "me", raw, fence=n) for n, raw in enumerate(claim(broker, "me", 2), 1))
    assert executor.execute(first) is True  # on the lane, which it fills
    waiting = threading.Thread(target=executor.execute, args=(second,))
    waiting.start()
    time.sleep(0.2)
    lease["held"] = False  # lost while the second waited for room on the lane
    lane_free.set()
    waiting.join(5)
    wait_until(lambda: executor.async_lane.running == 0, 5, message="the lane to empty")
    assert started == ["t1"], "started on the lane after its lease was lost"
    assert broker.records.get_result("t2") is None and second.raw in broker.queue.held_by("q", "me")  # the reaper's
    executor.async_lane.close()


def test_a_forced_cancel_that_lands_as_the_run_registers_ends_it_cancelled_not_dead(broker, monkeypatch):
    registry = Registry()
    registry.add(Handler("x.ok", lambda: "done"))
    register(broker, "w", lease_ms=30_000)
    executor = executor_of(broker, registry, "w")
    push(broker, task_bytes("t4", "x.ok"))
    [raw] = claim(broker, "w", 1)
    registered = threading.Event()
    real_gauge = metrics.BUSY_WORKERS

    class SlowGauge:  # the worker thread is descheduled right after its run became visible
        def inc(self) -> None:
            registered.set()
            time.sleep(0.3)

        def dec(self) -> None:
            real_gauge.dec()

    monkeypatch.setattr(metrics, "BUSY_WORKERS", SlowGauge())
    worker = threading.Thread(target=executor.execute, args=(Claimed("q", "w", raw, fence=1),))
    worker.start()
    assert registered.wait(5)
    [run] = list(executor.time_limits.running.values())
    run.context.control.force()  # what the time limits do on a forced cancel
    run.force_stop()
    worker.join(5)

    assert broker.inspect.list_dead("q") == [], "a cancelled task was dead-lettered as a settling failure"
    assert broker.records.get_result("t4")["status"] == "CANCELLED"
    assert executor.time_limits.running == {}


@pytest.mark.parametrize("envelope_queue", ["", "elsewhere"])
def test_a_task_belongs_to_the_queue_it_was_claimed_from(broker, envelope_queue):
    # A foreign producer left the envelope's queue empty, or named another: the record, the
    # history index and the charts file the task under the queue it was pushed to.
    registry = Registry()
    registry.add(Handler("x.ok", lambda: "done"))
    register(broker, "w", lease_ms=30_000)
    executor = executor_of(broker, registry, "w")
    push(broker, task_bytes("t7", "x.ok", queue=envelope_queue))
    [raw] = claim(broker, "w", 1)
    executor.execute(Claimed("q", "w", raw, fence=1))
    assert broker.records.get_result("t7")["queue"] == "q"
    assert broker.client.zscore(broker.keys.history_status("q", "SUCCESSFUL"), "t7") is not None


def test_a_type_whose_row_allows_no_attempts_still_runs_its_tasks(broker):
    # max_attempts 0 (a row written without the admin's validation) must not read as "not ours".
    TaskType.objects.create(name="test.record", handler="test.record", queue="q", max_attempts=0)
    task_types = TaskTypeCache()
    task_types.refresh()
    register(broker, "me", lease_ms=30_000)
    push(broker, task_bytes("t8"))
    [raw] = claim(broker, "me", 1)
    executor_of(broker, default_registry, "me", task_types).execute(Claimed("q", "me", raw, fence=1))
    assert [run["task_id"] for run in recorded_runs(broker)] == ["t8"]
