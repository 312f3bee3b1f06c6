"""Scenario 7: delayed tasks due after more than a lease, with a consumer killed before they are due."""
from __future__ import annotations

import random

import pytest

from tasks_app import producer
from tasks_app.producer import TaskRequest
from tests.chaos.harness import LEASE_S, Fleet, Summary, scaled, tally, wait_finished
from tests.support.recording import recorded_runs

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]


@pytest.mark.timeout(180)
def test_delayed_tasks_run_once_and_never_early_across_a_kill(chaos_broker, consumer_process):
    broker = chaos_broker
    fleet = Fleet(consumer_process, broker, concurrency=4, prefetch=4)
    for consumer_id in ("d1", "d2"):
        fleet.spawn(consumer_id)
    fleet.wait_registered(["d1", "d2"])
    rng = random.Random()
    requests = [TaskRequest("test.record", delay_s=rng.uniform(LEASE_S * 1.2, LEASE_S * 2.5))
                for _ in range(scaled(300, 3000))]
    enqueued = producer.enqueue_many(requests)
    due_ms = {t.id: t.run_after_ms for t in enqueued}
    held = fleet.kill("d1")  # before anything is due
    fleet.spawn("d1-respawned")
    ids = list(due_ms)
    wait_finished(broker, ids, scaled(120, 600), fleet)

    result = tally(broker, ids)
    early = [run for run in recorded_runs(broker) if run["start_ms"] < due_ms[run["task_id"]]]
    lateness_s = max(run["start_ms"] - due_ms[run["task_id"]] for run in recorded_runs(broker)) / 1000
    Summary("7-delayed-across-kill", len(ids), result.total_runs, len(result.lost), len(result.duplicates),
            len(held), None, {"early": len(early), "max_lateness_s": round(lateness_s, 3)}).report()
    assert held == set(), "nothing was due yet, so the killed consumer held nothing"
    assert early == [], f"ran before their due time: {early[:3]}"
    assert result.lost == []
    assert result.duplicates == set()
