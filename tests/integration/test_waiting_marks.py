"""Waiting marks through a real consumer: READY until claimed, gone after; cancels; old producers' tasks."""

import time

import pytest
import redis

from tasks_app import cancel, cancel_many, producer
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task, encode_arguments, encode_task, payload_of
from tasks_app.protocol.records import ResultRecord
from tests.chaos.servers import RedisClusterServers
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs

pytestmark = pytest.mark.django_db


def record_of(broker, task_id: str) -> ResultRecord:
    return ResultRecord.from_fields(broker.records.get_result(task_id) or {})


def wait_finished(broker, task_id: str) -> ResultRecord:
    wait_until(lambda: record_of(broker, task_id).is_finished, 20, message=f"task {task_id} to finish")
    return record_of(broker, task_id)


def test_a_waiting_task_reads_ready_from_its_mark_until_a_consumer_runs_it(broker, consumer_in_thread):
    tasks = producer.enqueue("test.record", [1], queue="default", count=3)
    [single] = producer.enqueue("test.record", [2], queue="default")  # a known queue: enqueue_one
    [delayed] = producer.enqueue("test.record", queue="default", delay_s=0.3)
    ids = [task.id for task in [*tasks, single, delayed]]
    for task_id in ids:
        record = record_of(broker, task_id)
        assert (record.status, record.queue, record.type) == ("READY", "default", "test.record")
        assert not broker.client.exists(broker.keys.result(task_id))
    with consumer_in_thread():
        finished = [wait_finished(broker, task_id) for task_id in ids]
    assert [(r.status, r.attempts) for r in finished] == [("SUCCESSFUL", 1)] * 5
    assert (finished[3].args, finished[3].enqueued_at is not None) == ([2], True)  # the run wrote the rest
    # On a record its receipt made, the run stores no default and no id: readers fill them in.
    assert not {b"id", b"priority", b"args", b"kwargs"} & broker.client.hgetall(broker.keys.result(delayed.id)).keys()
    assert (finished[4].id, finished[4].args, finished[4].kwargs, finished[4].priority) == (delayed.id, [], {}, 0)
    assert all(broker.client.hget(*broker.keys.waiting_mark(task_id)) is None for task_id in ids)
    assert sorted(
        entry.task_id for entry in broker.records.history_window(["default"], None, None, None, 10)
    ) == sorted(ids)


def test_a_cancelled_waiting_task_is_dropped_unrun_by_the_consumer_that_claims_it(broker, consumer_in_thread):
    [doomed, kept] = producer.enqueue("test.record", queue="default", count=2)
    assert cancel(doomed.id, cancelled_by="test").outcome == "cancelled"
    assert broker.client.hget(*broker.keys.waiting_mark(doomed.id)) is None
    with consumer_in_thread():
        assert wait_finished(broker, kept.id).status == "SUCCESSFUL"
        wait_until(lambda: broker.inspect.queue_stats("default").pending == 0, 10, message="the queue to drain")
        time.sleep(0.3)
    assert [run["task_id"] for run in recorded_runs(broker)] == [kept.id]
    record = record_of(broker, doomed.id)
    assert (record.status, record.type, record.cancelled_by) == ("CANCELLED", "test.record", "test")


def test_an_old_producers_task_with_a_ready_record_and_no_mark_is_taken_and_run(broker, consumer_in_thread):
    payload = payload_of(*encode_arguments([3], {}))
    raw = encode_task(Task(id="old-1", type="test.record", queue="default", payload=payload, enqueued_at_ms=1))
    fields = {"type": "test.record", "queue": "default", "args": "[3]", "enqueued_at_ms": "1"}
    broker.client.hset(broker.keys.result("old-1"), mapping=fields)
    broker.client.lpush(broker.keys.pending("default"), raw)
    assert (record_of(broker, "old-1").status, record_of(broker, "old-1").args) == ("READY", [3])
    with consumer_in_thread(queues=["default"]):
        record = wait_finished(broker, "old-1")
    assert (record.status, record.args, record.attempts) == ("SUCCESSFUL", [3], 1)
    assert [run["task_id"] for run in recorded_runs(broker)] == ["old-1"]


def test_on_a_cluster_marks_are_written_read_dropped_by_receipts_and_cancelled(tmp_path, settings):
    settings.REDIS_CLUSTER = True
    cluster = RedisClusterServers(tmp_path).start()
    try:
        broker = Broker(redis.RedisCluster.from_url(cluster.url), "marks")
        tasks = producer.enqueue_many(
            [producer.TaskRequest("demo.echo", [n], queue="A") for n in range(20)], broker=broker
        )
        [single] = producer.enqueue("demo.echo", queue="A", broker=broker)
        ids = [task.id for task in [*tasks, single]]
        assert all(record_of(broker, task_id).status == "READY" for task_id in ids)
        assert all(not broker.client.exists(broker.keys.result(task_id)) for task_id in ids)
        held, doomed = ids[:10], ids[10:]
        assert broker.queue.claim_receipts([(i, 5) for i in held], 60, [("A", "demo.echo")] * 10) == [3] * 10
        assert all(broker.client.hget(*broker.keys.waiting_mark(i)) is None for i in held)
        assert [reply.outcome for reply in cancel_many(doomed, broker=broker)] == ["cancelled"] * len(doomed)
        assert all(broker.client.hget(*broker.keys.waiting_mark(i)) is None for i in doomed)
        assert {record_of(broker, i).status for i in doomed} == {"CANCELLED"}
        assert broker.queue.claim_receipts([(doomed[0], 6)], 60, [("A", "demo.echo")]) == [2]
        assert cancel_many([held[0]], broker=broker)[0].outcome == "requested"
    finally:
        cluster.remove()
