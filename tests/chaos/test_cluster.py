"""Scenario 8: the queue on a 3-master Redis Cluster (REDIS_CLUSTER=1): round trip and rate limit."""

from __future__ import annotations

import pytest

from tasks_app import producer
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.results import ResultRecord
from tests.chaos.harness import scaled

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]


def queues_on_different_nodes(broker: Broker) -> tuple[str, str]:
    """Two queue names whose hash tags live on different cluster nodes."""
    cluster = broker.client
    first = "east"
    first_node = cluster.get_node_from_key(broker.keys.pending(first)).name
    for n in range(1000):
        name = f"west{n}"
        if cluster.get_node_from_key(broker.keys.pending(name)).name != first_node:
            return first, name
    raise AssertionError("no second node found")


@pytest.mark.timeout(180)
def test_round_trip_on_two_queues_on_different_nodes(cluster_broker, consumer_process):
    broker = cluster_broker
    east, west = queues_on_different_nodes(broker)
    tasks = []
    for queue in (east, west):
        tasks += producer.enqueue("demo.echo", [queue], count=20, queue=queue)
        tasks += producer.enqueue("demo.echo", [queue], count=5, queue=queue, priority=5)
        tasks += producer.enqueue("demo.echo", [queue], count=5, queue=queue, delay_s=1)

    consumer = consumer_process("--burst", "--lease", "2", "--concurrency", "4", "--queue", east, "--queue", west)
    assert consumer.wait(timeout_s=90) == 0, consumer.log()

    for task in tasks:
        record = ResultRecord.from_fields(broker.get_result(task.id))
        assert record.status == "SUCCESSFUL", (task, consumer.log())
        assert record.return_value == {"args": [task.queue], "kwargs": {}}
    for queue in (east, west):
        stats = broker.queue_stats(queue)
        assert (stats.pending, stats.processing, stats.delayed, stats.dead) == (0, 0, 0, 0)
    assert set(broker.known_queues()) == {east, west}
    assert "CROSSSLOT" not in consumer.log()


@pytest.mark.timeout(120)
def test_rate_limit_holds_across_consumers_on_a_cluster(cluster_broker, consumer_process):
    from tasks_app.models import TaskType
    from tests.support.processes import wait_until
    from tests.support.recording import most_starts_in_any_window, recorded_runs

    broker = cluster_broker
    TaskType.objects.create(name="test.record", handler="test.record", rate_limit=5, rate_period=1.0)
    consumers = [consumer_process("--lease", "2", "--concurrency", "4") for _ in range(2)]
    wait_until(lambda: len(broker.live_consumers("default")) == 2, 30, message="two consumers to register")
    enqueued = producer.enqueue("test.record", count=scaled(40, 200))
    wait_until(
        lambda: len(recorded_runs(broker)) >= len(enqueued),
        scaled(60, 120),
        interval_s=0.5,
        message="every limited task to start",
    )

    runs = recorded_runs(broker)
    assert sorted(run["task_id"] for run in runs) == sorted(task.id for task in enqueued)
    assert {run["attempt"] for run in runs} == {1}
    assert most_starts_in_any_window([run["start_ms"] for run in runs], 1000) <= 5
    for consumer in consumers:
        assert "CROSSSLOT" not in consumer.log()
        assert consumer.terminate() == 0
