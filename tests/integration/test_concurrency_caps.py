"""max_running across real consumer processes on real Redis, timed on the Redis clock."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from tasks_app import producer
from tasks_app.consumer.claiming import Claimed
from tasks_app.consumer.gates import ConcurrencyGate
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task, encode_task
from tasks_app.protocol.limits import SlotSet, Waiter
from tasks_app.protocol.scripts import connect
from tests.chaos.servers import RedisServer
from tests.support.processes import wait_until
from tests.support.throttle_handlers import HOLD_KEY_SUFFIX, MODULES, most_at_once, spans

pytestmark = pytest.mark.django_db(transaction=True)

CAPPED = "test.span"


def ended(broker) -> list[dict]:
    return [event for event in spans(broker) if event["event"] == "end"]


def test_cap_of_two_holds_across_three_consumers_and_keeps_both_slots_busy(broker, consumer_process):
    TaskType.objects.create(name=CAPPED, handler=CAPPED, max_running=2)
    consumers = [consumer_process("--concurrency", "4", "--lease", "2", TASK_HANDLER_MODULES=MODULES) for _ in range(3)]
    wait_until(
        lambda: len(broker.inspect.queue_stats("default").consumers) == 3, 30, message="three consumers to register"
    )

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
    wait_until(
        lambda: len(broker.inspect.queue_stats("default").consumers) == 2, 30, message="the second consumer to register"
    )

    time.sleep(3)  # over a lease: the holder's renewals keep its slots
    assert sorted(e["task_id"] for e in spans(broker)) == sorted(task.id for task in held)
    [lease_deadline_ms] = [
        c["lease_deadline_ms"] for c in broker.inspect.queue_stats("default").consumers if c["pid"] == holder.pid
    ]
    killed_ms = broker.inspect.server_time_ms()
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


def wait_up_for(broker: Broker, ms: int) -> None:
    wait_until(lambda: int(broker.client.info("server")["uptime_in_seconds"]) * 1000 >= ms, 10, message="uptime")


@pytest.mark.parametrize("lost", [False, True])
def test_a_restarted_redis_counts_the_slots_of_live_runs_until_their_consumers_renew(tmp_path, key_prefix, lost):
    lease_ms = 2000
    server = RedisServer(tmp_path, "--appendonly", "yes", "--appendfsync", "always").start()
    try:
        broker = Broker(connect(server.url), key_prefix)
        slots, newcomer = SlotSet(CAPPED, None, 1), Waiter("q", b"+000b")
        wait_up_for(broker, lease_ms)
        assert broker.limits.acquire_slot(slots, "live", Waiter("q", b"+000a"), lease_ms, 60_000)[0]
        server.kill()
        time.sleep(lease_ms / 1000 + 0.3)  # down for longer than a lease: the holder's deadline is past
        server.start()
        if lost:  # not yet fsynced, or expired as idle while Redis was down
            broker.client.delete(broker.keys.running(CAPPED))
        assert not broker.limits.acquire_slot(slots, "newcomer", newcomer, lease_ms, 60_000)[
            0
        ]  # the live run still counts
        assert broker.limits.renew_slots({(CAPPED, None): ["live"]}, lease_ms, 60_000) == 1  # its consumer renews it
        wait_up_for(broker, lease_ms)
        broker.limits.renew_slots({(CAPPED, None): ["live"]}, lease_ms, 60_000)  # as every heartbeat does
        assert not broker.limits.acquire_slot(slots, "newcomer", newcomer, lease_ms, 60_000)[0]
        broker.limits.release_slot(slots, "live", 60_000, lease_ms)
        assert broker.limits.acquire_slot(slots, "newcomer", newcomer, lease_ms, 60_000)[0]
    finally:
        server.remove()


class RenewsFirst:
    """A broker whose heartbeat renews this consumer's slots just before each acquire_slot runs."""

    def __init__(self, broker: Broker) -> None:
        self.broker, self.gate = broker, None
        self.limits = self  # the only role the gate asks of it

    def acquire_slot(self, *args):
        self.gate.renew()
        return self.broker.limits.acquire_slot(*args)


def test_a_run_denied_a_slot_just_after_a_restart_leaves_no_holder_behind(tmp_path, key_prefix):
    server = RedisServer(tmp_path).start()  # just started: for a lease no slot is given out
    try:
        broker = Broker(connect(server.url), key_prefix)
        renews_first = RenewsFirst(broker)
        gate = renews_first.gate = ConcurrencyGate(renews_first, broker, 3.0, 5.0, threading.Event())
        slots = SlotSet(CAPPED, None, 1)
        task = Task(id="t1", type=CAPPED, queue="q")
        assert gate.acquire(Claimed("q", "c1", encode_task(task)), task, slots) is None
        assert (
            broker.client.zcard(broker.keys.running(*slots[:2])) == 0
        )  # its renewal did not put back a slot it never took
    finally:
        server.remove()


def test_a_keyed_cap_holds_per_value_across_consumers_while_values_run_side_by_side(broker, consumer_process):
    TaskType.objects.create(name=CAPPED, handler=CAPPED, max_running=1, max_running_key="tenant")
    env = {"TASK_HANDLER_MODULES": MODULES, "TASKS_THROTTLE_RECHECK_S": "1"}
    for _ in range(2):
        consumer_process("--concurrency", "6", "--lease", "2", **env)
    wait_until(
        lambda: len(broker.inspect.queue_stats("default").consumers) == 2, 30, message="two consumers to register"
    )
    tenants = [*range(8), "a b", {"nested": [1]}]  # plain values, and values that are hashed into their key
    for tenant in tenants:
        producer.enqueue(CAPPED, kwargs={"sleep_s": 0.1, "tenant": tenant}, count=4)
    wait_until(lambda: len(ended(broker)) >= 4 * len(tenants), 40, interval_s=0.2, message="every task to end")

    events = spans(broker)
    for tenant in tenants:
        assert most_at_once([e for e in events if e["tenant"] == tenant]) == 1, tenant
    assert most_at_once(events) > 1  # one value's cap holds back no other value


def test_a_cap_lowered_while_its_slots_are_held_starts_nothing_until_runs_end_below_it(broker, consumer_process):
    TaskType.objects.create(name=CAPPED, handler=CAPPED, max_running=3)
    hold = f"{broker.keys.prefix}:{HOLD_KEY_SUFFIX}"
    broker.client.set(hold, 1)
    env = {"TASK_HANDLER_MODULES": MODULES, "TASKS_THROTTLE_RECHECK_S": "1", "TASKS_CONFIG_REFRESH_S": "0.5"}
    consumer_process("--concurrency", "8", "--lease", "2", **env)
    held = producer.enqueue(CAPPED, kwargs={"hold": True}, count=3)
    wait_until(lambda: len(spans(broker)) == 3, 30, message="three held runs")
    TaskType.objects.filter(name=CAPPED).update(max_running=1)
    time.sleep(1.5)  # past the consumer's refresh of its settings
    rest = producer.enqueue(CAPPED, kwargs={"sleep_s": 0.05}, count=4)
    time.sleep(2.5)  # the waiters' fallback looks again meanwhile
    assert len(spans(broker)) == 3, "a task started while three runs held slots of a cap of one"
    broker.client.delete(hold)
    wait_until(lambda: len(ended(broker)) == 7, 30, message="every task to end")
    events = spans(broker)
    assert most_at_once([e for e in events if e["task_id"] in {t.id for t in rest}]) == 1
    assert sorted(e["task_id"] for e in events if e["event"] == "start") == sorted(t.id for t in (*held, *rest))
