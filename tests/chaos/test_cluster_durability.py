"""Redis Cluster: a flush acks its tasks only once a replica of each master that took its results has them."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import REGISTRY

from tasks_app import producer
from tasks_app.consumer.ack_batcher import AckBatcher
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task, decode_task, encode_task
from tasks_app.protocol.inspection import DeadTask, UniqueWindow
from tasks_app.protocol.records import ResultUpdate
from tests.chaos.servers import RedisClusterServers, RedisServer
from tests.support.broker_calls import deleted_before_the_move

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

TIMEOUTS_METRIC = "taskqueue_result_replication_timeouts_total"


def _timeouts() -> float:
    return REGISTRY.get_sample_value(TIMEOUTS_METRIC) or 0.0


def _claimed(broker: Broker, consumer_id: str, count: int) -> tuple[list[str], list[bytes]]:
    tasks = producer.enqueue("demo.echo", count=count)
    broker.leases.heartbeat(["default"], consumer_id, 10_000, {})
    return [t.id for t in tasks], broker.queue.claim("default", consumer_id, count)


def _ack_all(batcher: AckBatcher, ids: list[str], raws: list[bytes], consumer_id: str) -> list[bool | None]:
    outcomes: list[bool | None] = []
    for task_id, raw in zip(ids, raws, strict=True):
        batcher.ack("default", consumer_id, raw, ResultUpdate(task_id, {"status": "SUCCESSFUL"}, 60), outcomes.append)
    return outcomes


def _master_of(cluster: RedisClusterServers, broker: Broker, key: str) -> RedisServer:
    return cluster.server_on_port(broker.client.get_node_from_key(key).port)


def _status_on_replica(replica: RedisServer, key: str) -> bytes | None:
    client = redis.Redis(port=replica.port, single_connection_client=True)
    client.execute_command("READONLY")
    return client.hget(key, "status")


@contextlib.contextmanager
def _stopped(server: RedisServer) -> Iterator[None]:
    """SIGSTOP a node until the block ends: it keeps its connections but answers nothing, as a lagging replica."""
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


@pytest.mark.timeout(120)
def test_acks_wait_until_a_replica_has_the_results(replicated_cluster):
    cluster, shared = replicated_cluster
    broker = Broker(shared.client, shared.keys.prefix, shared.scripts, cluster_wait_ms=5000)
    ids, raws = _claimed(broker, "d1", 3)
    result_key = broker.keys.result(ids[0])
    replica = cluster.replica_of(_master_of(cluster, broker, result_key))
    batcher = AckBatcher(broker, threading.Event())
    outcomes = _ack_all(batcher, ids, raws, "d1")
    before = _timeouts()

    with _stopped(replica):
        flusher = threading.Thread(target=batcher.flush_once, args=(0.1,), daemon=True)
        flusher.start()
        time.sleep(1.0)
        assert broker.records.get_result(ids[0])["status"] == "SUCCESSFUL"  # written on its master...
        assert broker.client.llen(broker.keys.processing("default", "d1")) == 3  # ...but nothing acked yet
        assert outcomes == []
    flusher.join(timeout=10)

    assert not flusher.is_alive() and outcomes == [True, True, True]
    assert broker.client.llen(broker.keys.processing("default", "d1")) == 0
    assert _status_on_replica(replica, result_key) == b"SUCCESSFUL"
    assert _timeouts() == before


@pytest.mark.timeout(120)
def test_a_lagging_replica_delays_acks_by_the_wait_at_most_and_is_counted(replicated_cluster):
    cluster, shared = replicated_cluster
    broker = Broker(shared.client, shared.keys.prefix, shared.scripts, cluster_wait_ms=300)
    ids, raws = _claimed(broker, "d2", 3)
    replica = cluster.replica_of(_master_of(cluster, broker, broker.keys.result(ids[0])))
    batcher = AckBatcher(broker, threading.Event())
    outcomes = _ack_all(batcher, ids, raws, "d2")
    before = _timeouts()

    with _stopped(replica):
        started_s = time.monotonic()
        batcher.flush_once(block_s=0.1)
        took_s = time.monotonic() - started_s

    assert outcomes == [True, True, True]  # acked anyway: availability over a replica that lags
    assert broker.client.llen(broker.keys.processing("default", "d2")) == 0
    assert 0.3 <= took_s < 3.0
    # At least the stopped replica's wait; on a loaded host a healthy replica may miss 300 ms too.
    assert _timeouts() >= before + 1


@pytest.mark.timeout(120)
def test_a_requeued_dead_letter_is_pushed_only_once_a_replica_has_its_ready_record(replicated_cluster):
    cluster, shared = replicated_cluster
    broker = Broker(shared.client, shared.keys.prefix, shared.scripts, cluster_wait_ms=5000)
    task = Task(id="dead-1", type="demo.echo", queue="default", attempt=3, dead_reason="failed 3 of 3 attempts")
    broker.client.zadd(broker.keys.dead("default"), {encode_task(task): broker.inspect.server_time_ms()})
    broker.records.record_result(ResultUpdate(task.id, {"status": "FAILED", "dead_reason": task.dead_reason}, 60))
    record_key, pending = broker.keys.result(task.id), broker.keys.pending("default")
    replica = cluster.replica_of(_master_of(cluster, broker, record_key))
    dead = broker.inspect.list_dead_tasks("default")
    moved: list[DeadTask] = []

    with _stopped(replica):
        requeuer = threading.Thread(
            target=lambda: moved.extend(broker.inspect.requeue_dead_tasks("default", dead).moved)
        )
        requeuer.start()
        time.sleep(1.0)
        # A failover of the record's master now would bring the dead run's record back under a new run.
        assert broker.client.llen(pending) == 0
        assert broker.client.zcard(broker.keys.delayed("default")) == 1  # parked, out of the dead letters
        assert broker.records.get_result(task.id)["status"] == "READY"  # written on its master
    requeuer.join(timeout=10)

    assert [item.task_id for item in moved] == [task.id] and broker.client.llen(pending) == 1
    assert _status_on_replica(replica, record_key) == b"READY"


@pytest.mark.timeout(120)
def test_a_requeue_on_a_cluster_writes_records_only_for_the_tasks_it_moved(cluster_broker, monkeypatch):
    """A record Redis refuses stops no other requeue; a task no longer dead when the move runs keeps its record."""
    broker = cluster_broker
    for n in (1, 2, 3):
        task = Task(id=f"dead-{n}", type="demo.echo", queue="default", attempt=3, dead_reason="failed")
        broker.client.zadd(broker.keys.dead("default"), {encode_task(task): broker.inspect.server_time_ms()})
        broker.records.record_result(ResultUpdate(task.id, {"status": "FAILED"}, 60, fence=1))
    broker.client.delete(broker.keys.result("dead-2"))
    broker.client.set(broker.keys.result("dead-2"), "a foreign writer's")
    shown = broker.inspect.list_dead_tasks("default")
    deleted_before_the_move(monkeypatch, broker, "default", "dead-3", shown)
    moved = broker.inspect.requeue_dead_tasks("default", shown).moved

    assert sorted(dead.task_id for dead in moved) == ["dead-1", "dead-2"]
    pending = broker.client.lrange(broker.keys.pending("default"), 0, -1)
    assert sorted(decode_task(raw).id for raw in pending) == ["dead-1", "dead-2"]
    assert broker.client.zcard(broker.keys.delayed("default")) == 0  # none left parked
    assert broker.records.get_result("dead-1")["status"] == "READY"
    assert broker.records.get_result("dead-3")["status"] == "FAILED"


@pytest.mark.timeout(120)
def test_masters_without_replicas_are_not_waited_on(cluster_broker):
    broker = Broker(cluster_broker.client, cluster_broker.keys.prefix, cluster_broker.scripts, cluster_wait_ms=5000)
    ids, raws = _claimed(broker, "d3", 6)
    batcher = AckBatcher(broker, threading.Event())
    outcomes = _ack_all(batcher, ids, raws, "d3")
    before = _timeouts()

    started_s = time.monotonic()
    batcher.flush_once(block_s=0.1)

    assert time.monotonic() - started_s < 2.0  # a WAIT there would block the whole 5 s
    assert outcomes == [True] * 6 and _timeouts() == before
    assert [broker.records.get_result(task_id)["status"] for task_id in ids] == ["SUCCESSFUL"] * 6


@pytest.mark.timeout(120)
def test_scripts_work_again_after_the_client_default_node_failed_over(replicated_cluster):
    cluster, broker = replicated_cluster
    queues = ["q0", "q1", "q2", "q3", "q4", "q5"]
    assert broker.leases.heartbeat(queues, "d4", 10_000, {})
    victim = broker.client.get_node_from_key(broker.keys.consumers("q0"))
    broker.client.set_default_node(victim)  # redis-py asks this node for every script's keys
    replica = cluster.replica_of(cluster.server_on_port(victim.port))
    cluster.server_on_port(victim.port).kill()
    deadline = time.monotonic() + 30
    while redis.Redis(port=replica.port).info("replication")["role"] != "master":
        assert time.monotonic() < deadline, "the replica was never promoted"
        time.sleep(0.1)

    error: redis.RedisError | None = None
    while time.monotonic() < deadline:
        try:
            broker.leases.heartbeat(queues, "d4", 10_000)
            error = None
            break
        except redis.RedisError as exc:
            error = exc
            time.sleep(0.3)
    assert error is None, f"heartbeats still fail long after the failover: {error}"
    assert broker.client.get_node_from_key(broker.keys.consumers("q0")).port == replica.port


@pytest.mark.timeout(120)
def test_a_requeue_on_a_cluster_takes_a_unique_tasks_key_with_the_move(cluster_broker):
    """The key shares the queue's slot: a held one leaves its task dead, a free one is taken as the task is parked."""
    broker = cluster_broker
    for n, digest in ((1, "held"), (2, "free")):
        task = Task(id=f"dead-{n}", type="uniq.echo", queue="default", attempt=3, unique_digest=digest)
        broker.client.zadd(broker.keys.dead("default"), {encode_task(task): broker.inspect.server_time_ms()})
    broker.client.set(broker.keys.unique("default", "held"), "other", px=60_000)
    windows = {"uniq.echo": UniqueWindow(60_000, until_finished=True)}
    outcome = broker.inspect.requeue_dead_tasks("default", broker.inspect.list_dead_tasks("default"), windows)

    assert [dead.task_id for dead in outcome.moved] == ["dead-2"]
    assert [(dead.task_id, holder) for dead, holder in outcome.held] == [("dead-1", "other")]
    assert [decode_task(raw).id for raw in broker.client.lrange(broker.keys.pending("default"), 0, -1)] == ["dead-2"]
    assert broker.client.get(broker.keys.unique("default", "free")) == b"dead-2"
    assert (
        broker.records.get_result("dead-2")["unique_digest"] == "free" and broker.records.get_result("dead-1") is None
    )
    assert broker.client.zcard(broker.keys.dead("default")) == 1
