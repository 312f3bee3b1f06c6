"""Scenario 4: Redis itself crashes mid-run and comes back later than a lease."""

from __future__ import annotations

import time

import pytest

from tasks_app import producer
from tasks_app.protocol.broker import get_broker
from tests.chaos.harness import LEASE_S, Fleet, Summary, scaled, tally, wait_finished
from tests.support.handlers import runs_key
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

CONSUMERS = ("r1", "r2", "r3")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fsync", ["always", "everysec"])
def test_redis_restart_loses_nothing_and_runs_nothing_twice(start_redis, consumer_process, fsync):
    # SIGKILL of the Redis process: with everysec too, what was written reaches the page cache and
    # survives a process crash; only a machine crash loses the last second (docs/PROTOCOL.md).
    server = start_redis("--appendonly", "yes", "--appendfsync", fsync)
    broker = get_broker()
    fleet = Fleet(consumer_process, broker, concurrency=4, prefetch=4)
    for consumer_id in CONSUMERS:
        fleet.spawn(consumer_id)
    fleet.wait_registered(CONSUMERS)
    ids = [t.id for t in producer.enqueue("test.record", kwargs={"sleep_s": 0.02}, count=scaled(600, 5000))]
    wait_until(lambda: broker.client.llen(runs_key()) >= len(ids) // 3, 120, message="a third of the tasks to start")

    server.kill()
    time.sleep(LEASE_S * 1.5)  # down for longer than a lease: every stored deadline is now past
    server.start()
    restarted_ms = broker.inspect.server_time_ms()
    # Every task finishes with the consumers left running: tasks a claim moved just before Redis
    # died (its reply lost) are found by the claimer's reconciliation and returned, not stranded.
    wait_finished(broker, ids, scaled(120, 600), fleet)
    for consumer_id in CONSUMERS:
        assert fleet.processes[consumer_id].process.poll() is None, f"{consumer_id} exited"
        assert "lost its lease" not in fleet.processes[consumer_id].log(), f"{consumer_id} was reaped"

    result = tally(broker, ids, per_attempt=True)
    resumed_ms = min(run["start_ms"] for run in recorded_runs(broker) if run["start_ms"] >= restarted_ms)
    Summary(
        f"4-redis-restart-aof-{fsync}",
        len(ids),
        result.total_runs,
        len(result.lost),
        len(result.duplicates),
        0,
        (resumed_ms - restarted_ms) / 1000,
        {"down_s": LEASE_S * 1.5},
    ).report()
    assert result.lost == []
    assert result.duplicates == set(), "a live consumer's task was recovered after the restart"
