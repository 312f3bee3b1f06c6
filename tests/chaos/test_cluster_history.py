"""The history index on a 3-master Redis Cluster: periodic runs and unique tasks are filed READY when pushed."""

from __future__ import annotations

import pytest

from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.periodic.config import PeriodicConfig
from tasks_app.periodic.firing import fire_slot, run_id
from tasks_app.periodic.schedule import Schedule
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.periodic import SlotFiring
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
    assert broker.get_result(run)["status"] == "READY"
    assert broker.get_result(unique.id)["status"] == "READY"
    assert [entry.task_id for entry in broker.history_window(["tick"], "READY", None, None, 10)] == [unique.id, run]
