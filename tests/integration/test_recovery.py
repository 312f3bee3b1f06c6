"""Recovery against real Redis: lost claim replies, leftovers of an unclean run, failover and restart guards."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks_app import producer
from tasks_app.consumer.lifecycle import Consumer
from tasks_app.consumer.options import ConsumerOptions
from tasks_app.protocol.broker import Broker, get_broker
from tasks_app.protocol.codec import Task, encode_task
from tasks_app.protocol.leases import MAX_RECOVERIES
from tasks_app.protocol.scripts import Scripts, connect
from tests.chaos.servers import RedisClusterServers, RedisServer
from tests.support.consumers import running
from tests.support.processes import wait_until
from tests.support.proxy import RedisProxy
from tests.support.recording import runs_per_task


@pytest.fixture
def cluster(settings, key_prefix: str, tmp_path: Path) -> Iterator[RedisClusterServers]:
    """A private 3-master Redis Cluster that this test (producer, handlers, consumer) uses."""
    original = (settings.REDIS_URL, settings.REDIS_CLUSTER)
    servers = RedisClusterServers(tmp_path).start()
    settings.REDIS_URL, settings.REDIS_CLUSTER = servers.url, True
    try:
        yield servers
    finally:
        settings.REDIS_URL, settings.REDIS_CLUSTER = original
        servers.remove()


def route_through(broker: Broker, node_port: int, proxy: RedisProxy) -> None:
    """Send a cluster broker's commands for one node through `proxy`."""
    nodes = broker.client.nodes_manager
    nodes.address_remap = lambda addr: ("127.0.0.1", proxy.port) if addr[1] == node_port else addr
    nodes.initialize()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("lost", ["claim script", "BLMOVE"])
def test_tasks_moved_by_a_claim_whose_reply_was_lost_still_run(cluster, lost):
    # Before: the client re-sent the command on its own after re-reading the slots; the first
    # call's tasks sat in the live consumer's list, unknown to it, until it exited.
    broker = get_broker()
    scripts = Scripts()
    broker.client.script_load(scripts.sources["claim"])
    marker = scripts.shas["claim"].encode() if lost == "claim script" else b"BLMOVE"
    node = broker.client.get_node_from_key(broker.keys.pending("default"))
    proxy = RedisProxy(node.port, drop_reply_to=marker)
    try:
        consumer = Consumer(ConsumerOptions(lease_s=30, block_s=0.5, concurrency=2, prefetch=2))
        route_through(consumer.broker, node.port, proxy)  # the consumer's own clients, as it connects
        first = producer.enqueue("test.record", count=3) if lost == "claim script" else []
        with running(consumer):
            if lost == "BLMOVE":
                wait_until(
                    lambda: broker.inspect.queue_stats("default").consumers, 10, message="the consumer to register"
                )
                time.sleep(0.3)  # the claimer is blocked in BLMOVE now
                first = producer.enqueue("test.record", count=1)
            wait_until(proxy.dropped.is_set, 10, message=f"a {lost} reply to be dropped")
            later = producer.enqueue("test.record", count=2)
            wanted = {task.id for task in [*first, *later]}
            wait_until(
                lambda: wanted <= set(runs_per_task(broker)),
                10,
                message="every task, those of the lost claim included, to run",
            )
        assert all(count == 1 for count in runs_per_task(broker).values())
        assert not broker.queue.held_by("default", consumer.consumer_id)
    finally:
        proxy.close()


@pytest.mark.django_db
def test_a_consumers_clients_never_resend_a_command_by_themselves(cluster):
    consumer = Consumer(ConsumerOptions())
    assert consumer.broker.client.retry.get_retries() == 0
    assert consumer.heartbeat_broker.client.retry.get_retries() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("where", ["processing", "staging"])
def test_a_task_in_a_live_consumers_list_that_it_does_not_hold_is_returned_within_a_lease(
    broker, consumer_in_thread, where
):
    # The audit: whatever put it there (a lost reply no error told us of; a script behind a blocking
    # move that failed, for a staged task), it must not wait until the consumer exits.
    with consumer_in_thread(lease_s=1.0) as consumer:
        wait_until(lambda: broker.inspect.queue_stats("default").consumers, 10, message="the consumer to register")
        stray = encode_task(Task(id="stray-1", type="test.record", queue="default"))
        broker.client.lpush(getattr(broker.keys, where)("default", consumer.consumer_id), stray)
        wait_until(lambda: runs_per_task(broker)["stray-1"] == 1, 10, message="the stray task to run")
        time.sleep(0.5)
    assert runs_per_task(broker) == {"stray-1": 1}


@pytest.mark.django_db(transaction=True)
def test_byte_identical_tasks_held_at_once_are_counted_apart(broker, consumer_in_thread):
    twin = encode_task(Task(id="twin", type="test.record", queue="default", payload=b'{"kwargs": {"sleep_s": 1.0}}'))
    broker.client.lpush(broker.keys.pending("default"), twin, twin)
    with consumer_in_thread(concurrency=1, prefetch=1) as consumer:
        wait_until(lambda: runs_per_task(broker)["twin"] == 2, 10, message="the second twin to start")
        wait_until(
            lambda: len(broker.queue.held_by("default", consumer.consumer_id)) == 1, 10, message="the first twin's ack"
        )
        time.sleep(0.1)  # the ack's callback lets go of the first twin
        consumer.claimer("default").reconcile()  # the second twin still runs: not a stray
        assert broker.queue.held_by("default", consumer.consumer_id) == [twin]
        assert broker.client.llen(broker.keys.pending("default")) == 0
        wait_until(lambda: not broker.queue.held_by("default", consumer.consumer_id), 10, message="the twin to finish")
        time.sleep(0.3)
    assert runs_per_task(broker)["twin"] == 2


@pytest.mark.django_db(transaction=True)
def test_a_fixed_id_restarted_after_each_death_dead_letters_the_task_that_kills_it(broker, consumer_process):
    # What compose's `restart: unless-stopped` does; the lease is long, so no reaper ever acts.
    [pill] = producer.enqueue("test.kill_self")
    deaths = 0
    for _ in range(MAX_RECOVERIES + 3):
        process = consumer_process("--consumer-id", "fixed", "--lease", "30", "--concurrency", "2", "--prefetch", "0")
        try:
            wait_until(
                lambda process=process: (
                    process.process.poll() is not None or broker.client.zcard(broker.keys.dead("default"))
                ),
                30,
                message="the consumer to die or the pill to be dead-lettered",
            )
        finally:
            process.stop()
        if broker.client.zcard(broker.keys.dead("default")):
            break
        deaths += 1
    [(member, _)] = broker.inspect.list_dead("default")
    assert pill.id.encode() in member and b"recovered 4 times" in member
    assert deaths == MAX_RECOVERIES + 1


def reap_status(broker: Broker, consumer_id: str, lease_ms: int) -> int:
    return broker.leases.reap("q", consumer_id, lease_ms).status


def expired_consumer(broker: Broker, consumer_id: str, lease_ms: int) -> None:
    broker.leases.heartbeat(["q"], consumer_id, lease_ms, {"lease_ms": lease_ms})
    broker.client.lpush(
        broker.keys.processing("q", consumer_id), encode_task(Task(id="t", type="demo.echo", queue="q"))
    )
    broker.client.zadd(broker.keys.consumers("q"), {consumer_id: 1})


def test_reaping_waits_until_a_restarted_redis_has_been_up_for_a_lease(tmp_path: Path, key_prefix):
    server = RedisServer(tmp_path).start()
    try:
        broker = Broker(connect(server.url), key_prefix)
        expired_consumer(broker, "c1", 2000)
        assert reap_status(broker, "c1", 2000) == -2
        assert broker.client.llen(broker.keys.processing("q", "c1")) == 1
        wait_until(lambda: int(broker.client.info("server")["uptime_in_seconds"]) >= 3, 10, message="uptime")
        assert reap_status(broker, "c1", 2000) == 1
    finally:
        server.remove()


def test_reaping_waits_a_lease_after_a_replica_is_promoted(tmp_path: Path, key_prefix):
    primary = RedisServer(tmp_path).start()
    replica = RedisServer(tmp_path, "--replicaof", "127.0.0.1", str(primary.port)).start()
    try:
        old, new = Broker(connect(primary.url), key_prefix), Broker(connect(replica.url), key_prefix)
        wait_until(lambda: new.client.info("replication")["master_link_status"] == "up", 10, message="sync")
        wait_until(lambda: int(new.client.info("server")["uptime_in_seconds"]) >= 2, 10, message="uptime")
        expired_consumer(old, "c1", 1000)
        old.client.wait(1, 2000)
        new.client.replicaof("NO", "ONE")  # the failover: a replica with a long uptime takes over
        assert reap_status(new, "c1", 1000) == -2
        new.leases.heartbeat(["q"], "live", 1000, {"lease_ms": 1000})  # live consumers renew on the new primary
        assert reap_status(new, "c1", 1000) == -2
        time.sleep(1.1)
        assert reap_status(new, "c1", 1000) == 1
    finally:
        replica.remove()
        primary.remove()


@pytest.mark.django_db(transaction=True)
def test_a_suspect_of_one_queue_runs_while_the_consumers_other_queues_are_idle(broker, consumer_in_thread):
    # Before: an idle queue's claimer held the consumer's one suspect slot through each of its
    # blocking claims, so the suspects of every other queue it consumes waited for good.
    suspect = encode_task(Task(id="suspect-1", type="test.record", queue="b"))
    broker.client.rpush(broker.keys.suspects("b"), suspect)
    with consumer_in_thread(queues=["a1", "a2", "a3", "b"], block_s=2.0):
        wait_until(lambda: runs_per_task(broker)["suspect-1"] == 1, 8, message="the suspect to run")


@pytest.mark.django_db(transaction=True)
def test_a_task_a_killed_consumer_left_between_its_move_and_its_receipt_runs_once(broker, consumer_in_thread):
    # kill -9 after `BLMOVE pending staging`, before the script behind it: the task sits staged.
    [task] = producer.enqueue("test.record")
    broker.leases.heartbeat(["default"], "frozen", 300, {"lease_ms": 300})
    broker.client.lmove(broker.keys.pending("default"), broker.keys.staging("default", "frozen"), "RIGHT", "LEFT")
    with consumer_in_thread(lease_s=1.0):
        wait_until(lambda: runs_per_task(broker)[task.id] == 1, 10, message="the staged task to be recovered and run")
        time.sleep(0.5)
    assert runs_per_task(broker) == {task.id: 1}
    assert broker.queue.held_and_staged("default", "frozen") == ([], [])
