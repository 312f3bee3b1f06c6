"""Unique tasks, cancelling queued and running tasks, and progress, against real Redis and real consumers."""

from __future__ import annotations

import threading
import time

import pytest

import tasks_app
from tasks_app import producer
from tasks_app.control import CANCELLED, REQUESTED
from tasks_app.models import TaskType
from tasks_app.protocol.records import ResultRecord
from tests.support.enqueued import is_idle
from tests.support.handlers import CANCEL_NOTICED_SUFFIX
from tests.support.processes import wait_until
from tests.support.recording import runs_per_task

pytestmark = pytest.mark.django_db(transaction=True)


def record_of(broker, task_id: str) -> ResultRecord:
    return ResultRecord.from_fields(broker.records.get_result(task_id) or {})


def statuses(broker, ids) -> dict[str, str]:
    return {task_id: record_of(broker, task_id).status for task_id in ids}


def test_unique_enqueues_give_one_task_per_key_and_window(broker, consumer_in_thread):
    TaskType.objects.create(name="test.record", handler="test.record", unique_for_s=1.5)
    first = producer.enqueue("test.record", [1], count=5)
    assert len({task.id for task in first}) == 1 and [task.duplicate for task in first] == [False] + [True] * 4
    other = producer.enqueue("test.record", [2])[0]
    keyed = producer.enqueue("test.record", [3], unique_key="k")[0]
    assert producer.enqueue("test.record", [4], unique_key="k")[0].id == keyed.id  # the key, not the args

    ids: list[str] = []
    barrier = threading.Barrier(8)

    def enqueue_at_once() -> None:
        barrier.wait()
        ids.append(producer.enqueue("test.record", [5])[0].id)

    threads = [threading.Thread(target=enqueue_at_once) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(ids)) == 1

    with consumer_in_thread(concurrency=2):
        expected = {first[0].id, other.id, keyed.id, ids[0]}
        wait_until(lambda: set(runs_per_task(broker)) == expected, 20, message="each unique task to run")
        time.sleep(0.3)
    assert sorted(runs_per_task(broker).values()) == [1, 1, 1, 1]
    wait_until(lambda: producer.enqueue("test.record", [1])[0].id != first[0].id, 5, message="the window to end")


def test_unique_until_finished_frees_the_key_when_the_task_ends(broker, consumer_in_thread):
    TaskType.objects.create(name="test.record", handler="test.record", unique_for_s=600, unique_until="finished")
    first = producer.enqueue("test.record", [1])[0]
    assert producer.enqueue("test.record", [1])[0].id == first.id
    with consumer_in_thread():
        wait_until(lambda: record_of(broker, first.id).status == "SUCCESSFUL", 15, message="the first run")
        wait_until(lambda: producer.enqueue("test.record", [1])[0].id != first.id, 5, message="the key to be freed")


def test_cancelled_pending_and_delayed_tasks_never_run_and_the_others_do(broker, consumer_process):
    pending = [task.id for task in producer.enqueue("test.record", count=6)]
    delayed = [task.id for task in producer.enqueue("test.record", delay_s=1.0, count=6)]
    cancelled = pending[:3] + delayed[:3]
    for task_id in cancelled:
        assert tasks_app.cancel(task_id, cancelled_by="tester").outcome == CANCELLED
    with pytest.raises(tasks_app.TaskAlreadyFinished):
        tasks_app.cancel(cancelled[0])
    with pytest.raises(tasks_app.TaskNotFound):
        tasks_app.cancel("no-such-task")

    consumer = consumer_process("--concurrency", "4", "--burst")
    assert consumer.wait(60) == 0, consumer.log()
    assert set(runs_per_task(broker)) == set(pending[3:] + delayed[3:])
    assert set(statuses(broker, cancelled).values()) == {"CANCELLED"}
    assert set(statuses(broker, pending[3:] + delayed[3:]).values()) == {"SUCCESSFUL"}
    record = record_of(broker, cancelled[0])
    assert record.cancelled_by == "tester" and record.cancelled_at is not None and record.attempts == 0
    assert is_idle(broker, ["default"])  # the cancelled ones were dropped, not left behind


def test_a_cancelled_task_whose_type_or_handler_is_gone_is_dropped_not_dead_lettered(broker, consumer_process):
    TaskType.objects.create(name="gone.type", handler="demo.echo")
    TaskType.objects.create(name="gone.handler", handler="demo.echo")
    unknown = producer.enqueue("gone.type")
    no_handler = producer.enqueue("gone.handler")
    # Since they were enqueued: one type deleted, the other's handler renamed to one nobody registers;
    # either is dead-lettered if it runs.
    TaskType.objects.filter(name="gone.type").delete()
    TaskType.objects.filter(name="gone.handler").update(handler="gone.handler")
    for task in (*unknown, *no_handler):
        assert tasks_app.cancel(task.id, cancelled_by="tester").outcome == CANCELLED
    consumer = consumer_process("--burst")
    assert consumer.wait(60) == 0, consumer.log()
    assert set(statuses(broker, [t.id for t in (*unknown, *no_handler)]).values()) == {"CANCELLED"}
    assert broker.inspect.list_dead("default") == []
    assert is_idle(broker, ["default"])


def test_a_running_cooperative_task_sees_the_cancel_within_a_second_and_ends_cancelled(broker, consumer_process):
    task_id = producer.enqueue("test.cooperative")[0].id
    consumer = consumer_process("--concurrency", "2")
    wait_until(lambda: record_of(broker, task_id).status == "RUNNING", 30, message="the task to start")
    reply = tasks_app.cancel(task_id, cancelled_by="tester")
    assert reply.outcome == REQUESTED
    noticed_key = f"{broker.keys.prefix}:{CANCEL_NOTICED_SUFFIX}"
    noticed_ms = int(wait_until(lambda: broker.client.get(noticed_key), 10, message="the handler to notice"))
    assert noticed_ms - reply.at_ms < 1000
    wait_until(lambda: record_of(broker, task_id).status == "CANCELLED", 10, message="the run to end cancelled")
    record = record_of(broker, task_id)
    assert record.attempts == 1 and record.errors == [] and record.cancel_requested_at is not None
    assert consumer.terminate() == 0, consumer.log()


def test_a_cancel_racing_the_claim_either_prevents_the_run_or_is_reported_too_late(broker, consumer_in_thread):
    replies: dict[str, str] = {}
    with consumer_in_thread(concurrency=4, prefetch=2):
        producer.enqueue("test.record")  # the consumer is up and claiming once this one ran
        wait_until(lambda: runs_per_task(broker), 15, message="the consumer to start")
        for n in range(40):  # each cancel goes out about when the consumer claims its task
            # One in five is due 50 ms later, so that some cancels surely come before their claim
            # (an idle consumer claims within a round trip of the push).
            task_id = producer.enqueue("test.record", delay_s=0.05 if n % 5 == 0 else 0)[0].id
            time.sleep((n % 5) * 0.01)
            try:
                replies[task_id] = tasks_app.cancel(task_id).outcome
            except tasks_app.TaskAlreadyFinished:
                replies[task_id] = "finished"
        done = {"SUCCESSFUL", "CANCELLED"}
        wait_until(lambda: set(statuses(broker, replies).values()) <= done, 30, message="every task to end")
        time.sleep(0.3)
    ran = runs_per_task(broker)
    final = statuses(broker, replies)
    for task_id, outcome in replies.items():
        if outcome == CANCELLED:
            assert task_id not in ran and final[task_id] == "CANCELLED"
        else:  # too late: it had started (a plain handler ignores the request and succeeds)
            assert ran[task_id] == 1 and final[task_id] == "SUCCESSFUL"
    assert CANCELLED in replies.values() and set(replies.values()) - {CANCELLED}  # both sides of the race
    assert max(ran.values()) == 1 and is_idle(broker, ["default"])


def test_progress_reported_by_a_handler_is_read_increasing_through_the_api(broker, staff, consumer_in_thread):
    task_id = producer.enqueue("test.progress", kwargs={"steps": 5, "step_s": 0.4})[0].id
    seen: list[float] = []
    with consumer_in_thread():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            body = staff.get(f"/api/tasks/{task_id}/").json()
            if body["progress"] and (not seen or seen[-1] != body["progress"]["current"]):
                seen.append(body["progress"]["current"])
            if body["status"] == "SUCCESSFUL":
                break
            time.sleep(0.1)
    assert seen == sorted(seen) and len(seen) >= 3 and seen[-1] == 5
    progress = staff.get(f"/api/tasks/{task_id}/").json()["progress"]
    assert progress["total"] == 5 and progress["message"] == "step 5" and progress["updated_at"]


def test_an_async_handler_reports_progress_and_sees_the_cancel_within_a_second(broker, staff, consumer_process):
    task_id = producer.enqueue("test.async_cooperative", kwargs={"step_s": 0.2})[0].id
    consumer = consumer_process("--concurrency", "2")
    seen: list[int] = []

    def progress_read() -> bool:
        body = staff.get(f"/api/tasks/{task_id}/").json()
        if body["progress"] and (not seen or seen[-1] != body["progress"]["current"]):
            seen.append(body["progress"]["current"])
        return len(seen) >= 4

    wait_until(progress_read, 30, interval_s=0.1, message="progress to be read four times")
    assert seen == sorted(seen) and len(set(seen)) == len(seen), "increasing"
    reply = tasks_app.cancel(task_id, cancelled_by="tester")
    noticed_key = f"{broker.keys.prefix}:{CANCEL_NOTICED_SUFFIX}"
    noticed_ms = int(wait_until(lambda: broker.client.get(noticed_key), 10, message="the coroutine to notice"))
    assert noticed_ms - reply.at_ms < 1000
    wait_until(lambda: record_of(broker, task_id).status == "CANCELLED", 10, message="the run to end cancelled")
    record = record_of(broker, task_id)
    assert record.attempts == 1 and record.errors == []
    assert record.progress is not None and record.progress["current"] >= seen[-1], "its last progress, then its end"
    assert consumer.terminate() == 0, consumer.log()


def test_a_task_cancelled_while_it_waits_prefetched_behind_a_slow_one_never_starts(broker, consumer_in_thread):
    with consumer_in_thread(concurrency=1, prefetch=1):
        [slow] = producer.enqueue("test.record", kwargs={"sleep_s": 1.0})
        wait_until(lambda: slow.id in runs_per_task(broker), 10, message="the slow task to start")
        [waiting] = producer.enqueue("test.record")
        wait_until(
            lambda: broker.records.get_result(waiting.id).get("claimed_fence"), 10, message="it to be prefetched"
        )
        assert tasks_app.cancel(waiting.id).outcome == REQUESTED  # claimed: the consumer holding it decides
        wait_until(lambda: record_of(broker, waiting.id).is_finished, 10, message="the waiting task to end")
    assert waiting.id not in runs_per_task(broker), "it had not started when it was cancelled"
    record = record_of(broker, waiting.id)
    assert (record.status, record.attempts) == ("CANCELLED", 0)
    assert record_of(broker, slow.id).status == "SUCCESSFUL" and is_idle(broker, ["default"])
