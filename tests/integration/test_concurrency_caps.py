"""max_running across real consumer processes on real Redis, timed on the Redis clock."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from tasks_app import producer
from tasks_app.models import TaskType
from tests.support.processes import wait_until
from tests.support.throttle_handlers import HOLD_KEY_SUFFIX, MODULES, most_at_once, spans

pytestmark = pytest.mark.django_db(transaction=True)

CAPPED = "test.span"


def ended(broker) -> list[dict]:
    return [event for event in spans(broker) if event["event"] == "end"]


def test_cap_of_two_holds_across_three_consumers_and_keeps_both_slots_busy(broker, consumer_process):
    TaskType.objects.create(name=CAPPED, handler=CAPPED, max_running=2)
    consumers = [consumer_process("--concurrency", "4", "--lease", "2", TASK_HANDLER_MODULES=MODULES) for _ in range(3)]
    wait_until(lambda: len(broker.live_consumers("default")) == 3, 30, message="three consumers to register")

    enqueued = producer.enqueue(CAPPED, kwargs={"sleep_s": 0.3}, count=24)
    wait_until(lambda: len(ended(broker)) >= 24, 40, interval_s=0.2, message="all 24 tasks to end")

    events = spans(broker)
    starts = [e for e in events if e["event"] == "start"]
    assert sorted(e["task_id"] for e in starts) == sorted(task.id for task in enqueued)  # each ran once
    assert most_at_once(events) == 2
    elapsed_s = (max(e["t_ms"] for e in events) - min(e["t_ms"] for e in starts)) / 1000
    assert elapsed_s <= 3.6 * 1.3, [c.log() for c in consumers]  # woken as slots free, not by a retry sleep
    assert len({e["pid"] for e in starts}) >= 2


def test_slots_of_a_killed_consumer_free_when_its_lease_lapses_and_not_before(broker, consumer_process):
    TaskType.objects.create(name=CAPPED, handler=CAPPED, max_running=2)
    broker.client.set(f"{broker.keys.prefix}:{HOLD_KEY_SUFFIX}", 1)
    env = {"TASK_HANDLER_MODULES": MODULES, "TASKS_THROTTLE_RECHECK_S": "1"}
    holder = consumer_process("--concurrency", "2", "--prefetch", "0", "--lease", "2", **env)
    held = producer.enqueue(CAPPED, kwargs={"hold": True, "sleep_s": 0.1}, count=2)
    wait_until(lambda: len(spans(broker)) == 2, 30, message="the holder to start both capped tasks")
    other = consumer_process("--concurrency", "4", "--lease", "2", **env)
    rest = producer.enqueue(CAPPED, kwargs={"sleep_s": 0.1}, count=6)
    wait_until(lambda: len(broker.live_consumers("default")) == 2, 30, message="the second consumer to register")

    time.sleep(3)  # over a lease: the holder's renewals keep its slots
    assert sorted(e["task_id"] for e in spans(broker)) == sorted(task.id for task in held)
    [lease_deadline_ms] = [c["lease_deadline_ms"] for c in broker.live_consumers("default") if c["pid"] == holder.pid]
    killed_ms = broker.server_time_ms()
    holder.kill()
    broker.client.delete(f"{broker.keys.prefix}:{HOLD_KEY_SUFFIX}")
    wait_until(lambda: len(ended(broker)) >= 8, 40, interval_s=0.2, message="every task to finish after the kill")

    events = spans(broker)
    runs = Counter(e["task_id"] for e in events if e["event"] == "start")
    assert {task.id: runs[task.id] for task in rest} == {task.id: 1 for task in rest}
    assert all(runs[task.id] == 2 for task in held), other.log()  # the killed consumer's own ran again
    later = [e for e in events if e["event"] == "start" and e["pid"] == other.pid]
    assert min(e["t_ms"] for e in later) >= lease_deadline_ms  # the holder's lease had to lapse first
    assert most_at_once(events, open_until_ms=killed_ms) <= 2
