"""The ack batcher: results before acks in one flush, lost acks flagged, barriers, merged updates."""
from __future__ import annotations

import threading

import pytest

from tasks_app import producer
from tasks_app.ack_batcher import AckBatcher, merge_updates
from tasks_app.broker import Broker, ResultUpdate

pytestmark = pytest.mark.django_db


def test_successive_updates_of_a_task_merge_unless_both_append():
    started = ResultUpdate("a", {"status": "RUNNING", "attempts": "1"}, 60, append_worker_id="w1")
    done = ResultUpdate("a", {"status": "SUCCESSFUL"}, 90)
    other = ResultUpdate("b", {"status": "RUNNING"}, 60, append_worker_id="w1")
    rerun = ResultUpdate("a", {"status": "RUNNING"}, 60, append_worker_id="w2")

    merged = merge_updates([started, other, done, rerun])

    assert [u.task_id for u in merged] == ["a", "b", "a"]
    assert merged[0].fields == {"status": "SUCCESSFUL", "attempts": "1"}
    assert merged[0].append_worker_id == "w1" and merged[0].ttl_s == 90
    assert merged[2].append_worker_id == "w2"


def _claimed(broker: Broker, consumer_id: str, count: int) -> tuple[list[str], list[bytes]]:
    tasks = producer.enqueue("demo.echo", count=count)
    broker.heartbeat(["default"], consumer_id, 10_000, {})
    return [t.id for t in tasks], broker.claim("default", consumer_id, count)


def test_one_flush_records_results_then_acks_and_reports_each_task(broker):
    ids, raws = _claimed(broker, "c1", 3)
    give_up = threading.Event()
    batcher = AckBatcher(broker, give_up)
    outcomes: list[bool | None] = []
    for task_id, raw in zip(ids, raws):
        batcher.record(ResultUpdate(task_id, {"status": "RUNNING"}, 60, append_worker_id="c1"))
        batcher.ack("default", "c1", raw, ResultUpdate(task_id, {"status": "SUCCESSFUL"}, 60), outcomes.append)
    broker.client.lrem(broker.keys.processing("default", "c1"), 1, raws[1])  # as if it was reaped

    assert batcher.flush_once(block_s=0.1) == 6

    assert outcomes == [True, False, True]
    assert broker.client.llen(broker.keys.processing("default", "c1")) == 0
    for task_id in ids:
        record = broker.get_result(task_id)
        assert record["status"] == "SUCCESSFUL" and record["worker_ids"] == '["c1"]'


def test_barrier_returns_after_earlier_writes_and_close_flushes_the_rest(broker):
    ids, raws = _claimed(broker, "c2", 2)
    batcher = AckBatcher(broker, threading.Event())
    batcher.start()
    batcher.record(ResultUpdate(ids[0], {"status": "RUNNING"}, 60))
    batcher.barrier()
    assert broker.get_result(ids[0])["status"] == "RUNNING"

    acked: list[bool | None] = []
    batcher.ack("default", "c2", raws[0], None, acked.append)
    batcher.ack("default", "c2", raws[1], None, acked.append)
    batcher.close(timeout_s=10)

    assert acked == [True, True]
    assert broker.client.llen(broker.keys.processing("default", "c2")) == 0
