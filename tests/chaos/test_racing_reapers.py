"""Scenario 6: many reapers racing over the list of one dead consumer."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from django.conf import settings

from tasks_app import producer
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import decode_task
from tasks_app.protocol.keys import WAKE_TOKEN
from tasks_app.protocol.scripts import connect
from tests.chaos.harness import Summary, scaled, task_ids

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

REAPER_THREADS = 16
DEAD_LEASE_MS = 500


def race_reapers(broker: Broker) -> tuple[list[int], float]:
    """REAPER_THREADS threads reap consumer "dead" at once; return what each requeued, and how long it took."""
    barrier = threading.Barrier(REAPER_THREADS)
    requeued: list[int] = []
    lock = threading.Lock()

    def reap() -> None:
        own = Broker(connect(settings.REDIS_URL), broker.keys.prefix)  # a connection of its own
        barrier.wait()
        moved = 0
        while (outcome := own.leases.reap("default", "dead", DEAD_LEASE_MS)).status == 1:
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
    return requeued, time.monotonic() - started


@pytest.mark.timeout(180)
def test_racing_reapers_requeue_each_task_exactly_once(chaos_broker):
    broker = chaos_broker
    ids = [t.id for t in producer.enqueue("test.record", count=scaled(1500, 5000))]
    # A consumer that claimed a large batch and died: its lease is never renewed. It registers
    # only now, as enqueueing takes longer than its lease on a loaded machine.
    assert broker.leases.heartbeat(["default"], "dead", DEAD_LEASE_MS, {"lease_ms": DEAD_LEASE_MS})
    claimed = broker.queue.claim("default", "dead", len(ids))
    assert claimed is not None
    held_by_dead = task_ids(claimed)
    time.sleep(1.1)  # its lease is over, and Redis has been up for longer than it

    requeued, recovery_s = race_reapers(broker)

    # Reaped tasks wait as suspects (one runs per consumer at a time, so running 1,500 of them
    # would take a minute): count what the reapers put back, entry by entry, instead.
    keys = broker.keys
    requeued_entries = [
        *broker.client.lrange(keys.suspects("default"), 0, -1),
        *broker.client.lrange(keys.pending("default"), 0, -1),
    ]
    copies = Counter(decode_task(raw).id for raw in requeued_entries if raw != WAKE_TOKEN)
    Summary(
        "6-racing-reapers",
        len(ids),
        sum(copies.values()),
        len(set(ids) - set(copies)),
        sum(n - 1 for n in copies.values()),
        0,
        recovery_s,
        {"held_by_dead": len(held_by_dead), "reapers": REAPER_THREADS, "requeued_by_threads": sum(requeued)},
    ).report()
    assert len(requeued) == REAPER_THREADS
    assert sum(requeued) == len(held_by_dead) == len(ids)
    assert not broker.client.llen(keys.processing("default", "dead"))
    assert copies == Counter(dict.fromkeys(ids, 1)), "a task was requeued more than once, or not at all"
