"""Periodic schedules on a 3-master Redis Cluster: a slot claimed in the schedule's own slot fires in one queue only."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tasks_app.consumer.periodic_loop import PeriodicLoop
from tasks_app.models import TaskType
from tasks_app.periodic.config import PeriodicConfig
from tasks_app.periodic.schedule import Schedule
from tests.support.periodic import fire_around_a_queue_move, pushed_runs

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]


@pytest.mark.timeout(120)
def test_consumers_on_rows_read_before_and_after_a_queue_move_fire_each_slot_once_on_a_cluster(cluster_broker):
    broker = cluster_broker
    TaskType.objects.create(name="demo.echo", handler="demo.echo", queue="out")
    config = PeriodicConfig(name="roams", task_type="demo.echo", schedule=Schedule(interval_s=3600))
    fired, runs = fire_around_a_queue_move(broker, config, "out", "moved")
    assert runs == fired  # each slot once, where it was fired, and no catch-up run for a slot run elsewhere
    assert broker.records.get_result(pushed_runs(broker, "out")[-1].task_id)["queue"] == "out"
    # The next hour's slot, asked for by a consumer on the old rows first: it fires in the queue that claimed it.
    hour_ms = fired[-1].slot_ms
    old = replace(config, name="hourly", queue="out", saved_ms=hour_ms - 7_200_000)
    new = replace(old, queue="moved", saved_ms=hour_ms - 60_000)
    for snapshot in (old, new):
        PeriodicLoop(broker, 2.0, 3600.0, load=lambda snapshot=snapshot: [snapshot]).run_once()
    hourly = [
        (queue, run.slot_ms)
        for queue in ("out", "moved")
        for run in pushed_runs(broker, queue)
        if run.schedule == "hourly"
    ]
    assert hourly == [("out", hour_ms)]


@pytest.mark.timeout(120)
def test_a_slot_claimed_by_a_consumer_that_died_before_firing_it_fires_once_by_another_on_a_cluster(cluster_broker):
    broker = cluster_broker
    TaskType.objects.create(name="demo.echo", handler="demo.echo", queue="out")
    config = PeriodicConfig(name="hourly", task_type="demo.echo", schedule=Schedule(interval_s=3600))
    slot_ms = config.schedule.latest_at_or_before(broker.inspect.server_time_ms())
    claim = broker.scripts.run(
        broker.client, "claim_periodic", [broker.keys.periodic_claim(config.name)], [slot_ms, "out"]
    )
    assert claim[0] == b"claimed"  # then killed: no fire
    for _ in range(2):  # the others, one after the other
        PeriodicLoop(broker, 2.0, 3600.0, load=lambda: [config]).run_once()
    assert [run.slot_ms for run in pushed_runs(broker, "out") if run.schedule == "hourly"] == [slot_ms]
