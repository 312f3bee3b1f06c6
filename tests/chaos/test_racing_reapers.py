"""Scenario 6: many reapers racing over the list of one dead consumer."""
from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from django.conf import settings

from tasks_app import producer
from tasks_app.broker import Broker, connect
from tests.chaos.harness import Fleet, Summary, scaled, tally, task_ids, wait_finished

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

REAPER_THREADS = 16
DEAD_LEASE_MS = 500


@pytest.mark.timeout(180)
def test_racing_reapers_requeue_each_task_exactly_once(chaos_broker, consumer_process):
    broker = chaos_broker
    # A consumer that claimed a large batch and died: its lease is never renewed.
    assert broker.heartbeat(["default"], "dead", DEAD_LEASE_MS, {"lease_ms": DEAD_LEASE_MS})
    ids = [t.id for t in producer.enqueue("test.record", count=scaled(1500, 5000))]
    claimed = broker.claim("default", "dead", len(ids))
    assert claimed is not None
    held_by_dead = task_ids(claimed)
    time.sleep(1.1)  # its lease is over, and Redis has been up for longer than it

    barrier = threading.Barrier(REAPER_THREADS)
    requeued: list[int] = []
    lock = threading.Lock()

    def reap() -> None:
        own = Broker(connect(settings.REDIS_URL), broker.keys.prefix)  # a connection of its own
        barrier.wait()
        moved = 0
        while (outcome := own.reap("default", "dead", DEAD_LEASE_MS)).status == 1:
            moved += outcome.requeued
            if not outcome.remaining:
                break
        with lock:
            requeued.append(moved)

    threads = [threading.Thread(target=reap) for _ in range(REAPER_THREADS)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    recovery_s = time.monotonic() - started
    fleet = Fleet(consumer_process, broker, concurrency=8, prefetch=8)
    for consumer_id in ("x1", "x2", "x3"):
        fleet.spawn(consumer_id)
    wait_finished(broker, ids, scaled(120, 600), fleet)

    result = tally(broker, ids)
    Summary("6-racing-reapers", len(ids), result.total_runs, len(result.lost), len(result.duplicates), 0, recovery_s,
            {"held_by_dead": len(held_by_dead), "reapers": REAPER_THREADS,
             "requeued_by_threads": sum(requeued)}).report()
    assert len(requeued) == REAPER_THREADS
    assert sum(requeued) == len(held_by_dead) == len(ids)
    assert not broker.client.llen(broker.keys.processing("default", "dead"))
    assert result.lost == []
    assert result.duplicates == set(), "a task was requeued more than once"
    assert Counter(result.runs[task_id] for task_id in ids) == Counter({1: len(ids)})
