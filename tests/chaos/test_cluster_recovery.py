"""Scenario 8, recovery on Redis Cluster: kill -9 with queues on every master, and a master's failover."""

from __future__ import annotations

import pytest
import redis

from tasks_app.protocol import records
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Arguments, Task, encode_task
from tasks_app.protocol.enqueue import Enqueueable
from tasks_app.protocol.history import STATUSES
from tests.chaos.harness import Fleet, scaled
from tests.chaos.test_kill import assert_all_done, enqueue_everywhere, kill_one_of_two
from tests.support.handlers import runs_key
from tests.support.processes import wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

ARGS = Arguments([], {})


def queues_by_master(broker: Broker, per_master: int) -> dict[str, list[str]]:
    """Queue names whose hash-tag slots land on each master, `per_master` of them per master (by node name)."""
    by_master: dict[str, list[str]] = {node.name: [] for node in broker.client.get_primaries()}
    for n in range(100_000):
        queue = f"q{n}"
        master = broker.client.get_node_from_key(broker.keys.pending(queue)).name
        if len(by_master[master]) < per_master:
            by_master[master].append(queue)
        if all(len(queues) == per_master for queues in by_master.values()):
            return by_master
    raise AssertionError("no queue names found for every master")


@pytest.mark.timeout(600)
def test_kill_9_with_queues_on_every_master(cluster_broker, consumer_process):
    queues = [queue for queues in queues_by_master(cluster_broker, 2).values() for queue in queues]
    for run in range(scaled(3, 15)):
        kill_one_of_two(
            cluster_broker,
            consumer_process,
            queues,
            scenario="8-cluster-kill-9-spread",
            run=run,
            per_queue=scaled(100, 600),
        )


@pytest.mark.timeout(300)
def test_master_failover_loses_nothing(replicated_cluster, consumer_process):
    cluster, broker = replicated_cluster
    by_master = queues_by_master(broker, 1)
    queues = [queue for queues in by_master.values() for queue in queues]
    # Not the node the consumers were pointed at, nor the one holding the test's own list of runs:
    # a run appended there just before the kill, not yet replicated, would be the test's loss.
    spared = {cluster.servers[0].port, broker.client.get_node_from_key(runs_key()).port}
    victim_queue = next(
        queue for queue in queues if broker.client.get_node_from_key(broker.keys.pending(queue)).port not in spared
    )
    master = cluster.server_on_port(broker.client.get_node_from_key(broker.keys.pending(victim_queue)).port)
    replica = cluster.replica_of(master)
    fleet = Fleet(consumer_process, broker, queues, concurrency=4, prefetch=None)
    for consumer_id in ("f1", "f2"):
        fleet.spawn(consumer_id)
    fleet.wait_registered(["f1", "f2"])
    ids = enqueue_everywhere(queues, scaled(200, 1000), 0.01)
    cluster.wait_replicated(master)  # the tasks themselves are on the replica: a loss below is ours
    wait_until(lambda: broker.client.llen(runs_key()) >= len(ids) // 3, 60, message="a third of the tasks to start")
    master.kill()
    wait_until(
        lambda: redis.Redis(port=replica.port).info("replication")["role"] == "master",
        30,
        interval_s=0.1,
        message="the replica to be promoted",
    )
    assert_all_done(broker, fleet, ids, "8-cluster-master-failover", None)
    for consumer_id in ("f1", "f2"):
        assert fleet.processes[consumer_id].process.poll() is None, f"{consumer_id} exited\n{fleet.logs()}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("final", [False, True], ids=["retry", "dead-letter"])
def test_a_late_retry_or_dead_letter_of_a_reaped_run_leaves_the_reruns_state(cluster_broker, final):
    broker = cluster_broker
    task = Task(id="late-1", type="demo.echo", queue="q", attempt=1)
    raw = encode_task(task)
    broker.enqueuer.enqueue([Enqueueable(queue="q", raw=raw)], result_ttl_s=60)
    fences = []
    for consumer_id in ("c1", "c2"):  # c1 freezes past its lease and is reaped; c2 runs the task again
        broker.leases.heartbeat(["q"], consumer_id, 10_000, {"lease_ms": 10_000})
        fences.append(broker.queue.claim_with_suspect("q", consumer_id, 1).first_fence)
        assert broker.records.record_result(records.started(task, ARGS, consumer_id, 1, 3, 60, fences[-1])) == 1
        if consumer_id == "c1":  # reaped at once: the fresh cluster holds reaping for a lease otherwise
            assert broker.leases.reap("q", consumer_id, 10_000, own_earlier_run=True).requeued == 1
    assert broker.queue.ack("q", "c2", [raw], [records.succeeded(task, '"c2"', 2, 60, fences[1])]) == [True]

    error = records.error_record("builtins.RuntimeError", "late")
    failure = records.attempt_failed(task, error, 3, 60, final=final, retry_at_ms=9, dead_reason="x", fence=fences[0])
    if final:
        assert broker.queue.dead_letter("q", "c1", raw, raw, failure) is False
    else:
        assert broker.queue.retry_later("q", "c1", raw, raw, 0, 1000, failure) is False

    record = broker.records.get_result(task.id)
    assert (record["status"], record["return_value"]) == ("SUCCESSFUL", '"c2"') and "errors" not in record
    assert broker.client.zcard(broker.keys.delayed("q")) == broker.client.zcard(broker.keys.dead("q")) == 0
    filed = {status for status in STATUSES if broker.client.zscore(broker.keys.history_status("q", status), task.id)}
    assert filed == {"SUCCESSFUL"}
