"""Leases against real Redis: claims and renewals only under a live lease, and no start without one."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tasks_app import producer
from tasks_app.consumer.lifecycle import Consumer
from tasks_app.consumer.membership import LEASE_MARGIN_SHARE, LeaseClock
from tasks_app.consumer.options import ConsumerOptions
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task, encode_task
from tasks_app.protocol.scripts import connect
from tests.chaos.servers import RedisServer
from tests.support.consumers import running
from tests.support.processes import wait_until
from tests.support.proxy import RedisProxy
from tests.support.recording import recorded_runs


def lapse(broker: Broker, consumer_id: str, queue: str = "q") -> None:
    """Move a lease's deadline into the past, as if its renewals had stopped (it is not reaped)."""
    broker.client.zadd(broker.keys.consumers(queue), {consumer_id: 1})


def test_a_claim_under_a_lapsed_lease_takes_nothing(broker):
    broker.leases.heartbeat(["q"], "c1", 10_000, {"lease_ms": 10_000})
    broker.client.lpush(broker.keys.pending("q"), encode_task(Task(id="t1", type="demo.echo", queue="q")))
    lapse(broker, "c1")
    claimed = broker.queue.claim_with_suspect("q", "c1", 5)
    assert claimed is not None and claimed.lease_expired and claimed.tasks == []
    assert broker.client.llen(broker.keys.pending("q")) == 1
    assert broker.client.llen(broker.keys.processing("q", "c1")) == 0


def test_a_lapsed_lease_is_not_renewed(broker):
    broker.leases.heartbeat(["q"], "c1", 10_000, {"lease_ms": 10_000})
    assert broker.leases.heartbeat(["q"], "c1", 10_000) is True
    lapse(broker, "c1")
    assert broker.leases.heartbeat(["q"], "c1", 10_000) is False


def test_a_lease_that_lapsed_while_redis_was_away_is_renewed_while_reapers_wait(tmp_path: Path, key_prefix):
    # Just after a restart reapers hold off for a lease; the renewal honours the same grace,
    # so a live consumer that could not renew during the outage keeps its tasks.
    server = RedisServer(tmp_path).start()
    try:
        fresh = Broker(connect(server.url), key_prefix)
        fresh.leases.heartbeat(["q"], "c1", 5_000, {"lease_ms": 5_000})
        lapse(fresh, "c1")
        assert fresh.leases.heartbeat(["q"], "c1", 5_000) is True
        assert fresh.leases.reap("q", "c1", 5_000).status == -1
    finally:
        server.remove()


@pytest.mark.django_db
def test_the_heartbeat_gives_up_on_a_hung_renewal_well_within_a_third_of_the_lease(broker):
    consumer = Consumer(ConsumerOptions(lease_s=30), broker=broker)
    kwargs = consumer.heartbeat_broker.client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] <= 30 / 3 / 2 and kwargs["socket_connect_timeout"] <= 30 / 3 / 2


def test_the_lease_clock_is_fresh_only_within_lease_less_margin_of_the_last_renewal():
    clock = LeaseClock(0.6)
    assert not clock.fresh("c1")
    clock.renewed("c1", time.monotonic())
    assert clock.fresh("c1")
    time.sleep(0.6 * (1 - LEASE_MARGIN_SHARE) + 0.02)
    assert not clock.fresh("c1")
    clock.renewed("c1", time.monotonic())
    assert clock.fresh("c1")
    clock.renewed("c1.1", time.monotonic())  # a new identity: the old one's lease is gone
    assert clock.fresh("c1.1") and not clock.fresh("c1")


@pytest.mark.django_db(transaction=True)
def test_a_consumer_that_cannot_renew_starts_nothing_more_and_its_tasks_run_elsewhere(broker):
    # Four 1.8 s tasks, one at a time, renewals cut from the start (lease 6 s): the fourth is
    # due at 5.4 s, after lease - margin (5 s), still under the lease on the server's clock. It
    # must stay held; once its consumer is reaped it runs under the next identity.
    lease_s = 6.0
    tasks = producer.enqueue("test.record", kwargs={"sleep_s": 1.8}, count=4)
    port = broker.client.connection_pool.connection_kwargs["port"]
    proxy = RedisProxy(port)
    proxy.cut()
    try:
        consumer = Consumer(
            ConsumerOptions(lease_s=lease_s, concurrency=1, prefetch=3, block_s=0.5),
            broker=broker,
            heartbeat_broker=Broker(connect(proxy.url, timeout_s=0.5), broker.keys.prefix),
        )
        with running(consumer):
            first_id = wait_until(
                lambda: next(iter(broker.inspect.queue_stats("default").consumers), None),
                10,
                message="the consumer to register",
            )["id"]
            registered_ms = broker.client.zscore(broker.keys.consumers("default"), first_id) - lease_s * 1000
            time.sleep(lease_s + 2.0)  # lapsed, then reaped by its own reaper
            proxy.restore()
            wanted = {task.id for task in tasks}
            wait_until(
                lambda: wanted <= {run["task_id"] for run in recorded_runs(broker)}, 20, message="every task to run"
            )
    finally:
        proxy.close()
    runs = recorded_runs(broker)
    late = [
        run
        for run in runs
        if run["consumer"] == first_id
        and run["start_ms"] > registered_ms + lease_s * 1000 * (1 - LEASE_MARGIN_SHARE) + 250
    ]
    assert not late, f"started after its lease could have lapsed: {late}"
    assert any(run["consumer"] == f"{first_id}.1" for run in runs)


@pytest.mark.django_db(transaction=True)
def test_a_task_moved_into_a_lost_identitys_list_runs_even_when_its_lease_entry_vanished(broker, consumer_in_thread):
    # A failover that lost the lease entry: no lease, no tombstone, so no reaper looked there.
    with consumer_in_thread() as consumer:
        first_id = wait_until(
            lambda: next(iter(broker.inspect.queue_stats("default").consumers), None),
            10,
            message="the consumer to register",
        )["id"]
        broker.client.zrem(broker.keys.consumers("default"), first_id)
        wait_until(lambda: consumer.consumer_id != first_id, 10, message="the consumer to take a new id")
        late = encode_task(Task(id="late-1", type="test.record", queue="default"))
        broker.client.lpush(broker.keys.processing("default", first_id), late)  # a blocking claim in flight
        wait_until(lambda: recorded_runs(broker), 10, message="the late task to run")
    assert [run["task_id"] for run in recorded_runs(broker)] == ["late-1"]


@pytest.mark.django_db(transaction=True)
def test_a_lease_lost_on_one_queue_only_leaves_the_runs_on_the_others_alone(broker, consumer_in_thread):
    # Redis Cluster: a failover of one queue's node lost the lease entry there. Before, the old id
    # was no longer renewed anywhere, so the runs under it on the other queue were reaped and run
    # again while they still went on.
    [long] = producer.enqueue("test.record", queue="a", kwargs={"sleep_s": 4})
    with consumer_in_thread(queues=["a", "b"], lease_s=1.0) as consumer:
        wait_until(lambda: recorded_runs(broker), 10, message="the long task to start")
        first_id = consumer.consumer_id
        broker.client.zrem(broker.keys.consumers("b"), first_id)
        wait_until(lambda: consumer.consumer_id != first_id, 10, message="the consumer to take a new id")
        wait_until(lambda: broker.records.get_result(long.id)["status"] == "SUCCESSFUL", 20, message="the long task")
        assert [run["task_id"] for run in recorded_runs(broker)] == [long.id], "it ran once"
        wait_until(
            lambda: first_id not in [c["id"] for c in broker.inspect.queue_stats("a").consumers], 10, message="retired"
        )
        stats = broker.inspect.queue_stats("a")
        assert (stats.pending, stats.processing, [c["id"] for c in stats.consumers]) == (0, 0, [consumer.consumer_id])
