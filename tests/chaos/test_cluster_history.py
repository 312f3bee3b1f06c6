"""The history index on a 3-master Redis Cluster: periodic runs and unique tasks are filed READY when pushed."""

from __future__ import annotations

import time

import pytest

from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.periodic.config import PeriodicConfig
from tasks_app.periodic.firing import fire_slot, run_id
from tasks_app.periodic.schedule import Schedule
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task, encode_task
from tasks_app.protocol.periodic import SlotFiring
from tasks_app.protocol.queue import UniqueRelease
from tasks_app.protocol.records import ResultUpdate
from tests.support.periodic import current_slot_ms

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]


def indexed(broker: Broker, queue: str, status: str | None = None) -> list[str]:
    """The ids in `queue`'s history (of one status if given), oldest first."""
    key = broker.keys.history_status(queue, status) if status else broker.keys.history(queue)
    return [member.decode() for member in broker.client.zrange(key, 0, -1)]


@pytest.mark.timeout(120)
def test_periodic_runs_and_unique_tasks_are_indexed_ready_on_a_cluster(cluster_broker):
    broker = cluster_broker
    TaskType.objects.create(name="demo.echo", handler="demo.echo", queue="tick", unique_for_s=600)
    config = PeriodicConfig(name="tick.each.second", task_type="demo.echo", schedule=Schedule(interval_s=1))
    slot_ms = current_slot_ms(broker)
    assert fire_slot(config, SlotFiring(slot_ms, slot_ms - 1000, 60_000, "skip"), broker).outcome == "fired"
    unique = producer.enqueue("demo.echo", [7], queue="tick")[0]
    duplicate = producer.enqueue("demo.echo", [7], queue="tick")[0]

    run = run_id(config.name, slot_ms)
    assert duplicate.duplicate and duplicate.id == unique.id
    assert indexed(broker, "tick") == indexed(broker, "tick", "READY") == [run, unique.id]
    assert broker.records.get_result(run)["status"] == "READY"
    assert broker.records.get_result(unique.id)["status"] == "READY"
    assert [entry.task_id for entry in broker.records.history_window(["tick"], "READY", None, None, 10)] == [
        unique.id,
        run,
    ]


@pytest.mark.timeout(120)
def test_results_acks_unique_keys_and_chart_counts_on_a_cluster(cluster_broker):
    # The record lies in a slot of its own: chart counts go with the acks, and only for the writes
    # the records took; a unique task's key is freed by its ack, in its queue's slot.
    broker = cluster_broker
    broker.leases.heartbeat(["u"], "c1", 30_000, {"lease_ms": 30_000})
    broker.client.set(broker.keys.unique("u", "d1"), "t1", px=600_000)
    broker.client.lpush(broker.keys.pending("u"), encode_task(Task(id="t1", type="x", queue="u", unique_digest="d1")))
    [raw] = broker.queue.claim("u", "c1", 1) or []
    broker.records.record_result(ResultUpdate("late", {"status": "SUCCESSFUL"}, 60, fence=10, queue="u", task_type="x"))
    minute = int(time.time()) // 60
    before = sum(counts.get("ok|x", 0) for counts in broker.inspect.minute_counts("u", [minute, minute + 1]))
    ok = ResultUpdate("t1", {"status": "SUCCESSFUL"}, 60, fence=1, queue="u", task_type="x", run_s=0.1)
    turned_away = ResultUpdate("late", {"status": "SUCCESSFUL"}, 60, fence=5, queue="u", task_type="x", run_s=0.1)
    report = broker.queue.ack_many_reporting(
        [ok, turned_away], {("u", "c1"): [raw]}, releases={("u", "c1"): [UniqueRelease("d1", "t1")]}
    )
    assert report.flags == {("u", "c1"): [True]} and report.written == (1, 0)
    assert not broker.client.exists(broker.keys.unique("u", "d1"))
    after = sum(counts.get("ok|x", 0) for counts in broker.inspect.minute_counts("u", [minute, minute + 1]))
    assert after == before + 1


@pytest.mark.timeout(60)
def test_a_unique_task_enqueued_again_under_its_own_id_keeps_its_record_on_a_cluster(cluster_broker):
    # A retry of the same request with the same id (what "give the ids" recommends) is a
    # duplicate held by itself: the record it shares with the task that holds the key stays.
    broker = cluster_broker
    TaskType.objects.create(name="demo.echo", handler="demo.echo", queue="once", unique_for_s=600)
    request = producer.TaskRequest(type="demo.echo", args=[1], task_id="given-id")
    [first] = producer.enqueue_many([request])
    [again] = producer.enqueue_many([request])

    assert not first.duplicate and again.duplicate and again.id == "given-id"
    assert broker.records.get_result("given-id")["status"] == "READY"
    assert broker.records.get_result("given-id")["type"] == "demo.echo"
    assert broker.inspect.queue_stats("once").pending == 1
