"""Scenario 8: the queue on a 3-master Redis Cluster (REDIS_CLUSTER=1): round trip and rate limit."""

from __future__ import annotations

import itertools

import pytest

from tasks_app import producer
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.records import ResultRecord
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
        record = ResultRecord.from_fields(broker.records.get_result(task.id))
        assert record.status == "SUCCESSFUL", (task, consumer.log())
        assert record.return_value == {"args": [task.queue], "kwargs": {}}
    for queue in (east, west):
        stats = broker.inspect.queue_stats(queue)
        assert (stats.pending, stats.processing, stats.delayed, stats.dead) == (0, 0, 0, 0)
    assert set(broker.inspect.known_queues()) == {east, west}
    assert "CROSSSLOT" not in consumer.log()


@pytest.mark.timeout(120)
@pytest.mark.alone  # its start times are read at the handler's first line: load elsewhere would shift them
def test_rate_limit_holds_across_consumers_on_a_cluster(cluster_broker, consumer_process):
    from tasks_app.models import TaskType
    from tests.support.processes import wait_until
    from tests.support.recording import most_starts_in_any_window, recorded_runs

    broker = cluster_broker
    TaskType.objects.create(name="test.record", handler="test.record", rate_limit=5, rate_period=1.0)
    consumers = [consumer_process("--lease", "2", "--concurrency", "4") for _ in range(2)]
    wait_until(
        lambda: len(broker.inspect.queue_stats("default").consumers) == 2, 30, message="two consumers to register"
    )
    # Each consumer's first run of the handler opens its Cluster connections: done by unlimited
    # warm-up runs, so that set-up cannot delay the start a limited run records.
    TaskType.objects.create(name="test.warm_up", handler="test.record")
    warm_up = producer.enqueue("test.warm_up", kwargs={"sleep_s": 0.3}, count=8)
    wait_until(lambda: len(recorded_runs(broker)) >= len(warm_up), 60, message="the warm-up runs")
    enqueued = producer.enqueue("test.record", count=scaled(40, 200))
    wait_until(
        lambda: len(recorded_runs(broker)) >= len(enqueued) + len(warm_up),
        scaled(60, 120),
        interval_s=0.5,
        message="every limited task to start",
    )

    runs = [run for run in recorded_runs(broker) if run["type"] == "test.record"]
    assert sorted(run["task_id"] for run in runs) == sorted(task.id for task in enqueued)
    assert {run["attempt"] for run in runs} == {1}
    starts = sorted(run["start_ms"] for run in runs)
    gaps = [round(b - a) for a, b in itertools.pairwise(starts)]
    assert most_starts_in_any_window(starts, 1000) <= 5, f"gaps between starts (ms): {gaps}"
    for consumer in consumers:
        assert "CROSSSLOT" not in consumer.log()
        assert consumer.terminate() == 0


@pytest.mark.timeout(120)
def test_pause_and_concurrency_cap_hold_on_a_cluster(cluster_broker, consumer_process):
    import time

    from tasks_app.models import TaskType
    from tests.support.processes import wait_until
    from tests.support.throttle_handlers import MODULES, most_at_once, spans

    broker = cluster_broker
    # Keyed: the two tenants' slot sets hash to slots of their own, apart from the queue's.
    TaskType.objects.create(name="test.span", handler="test.span", max_running=2, max_running_key="tenant")
    assert broker.control.pause("default", by="chaos")
    consumers = [consumer_process("--lease", "2", "--concurrency", "4", TASK_HANDLER_MODULES=MODULES) for _ in range(2)]
    enqueued = [
        *producer.enqueue("test.span", kwargs={"sleep_s": 0.2, "tenant": "a"}, count=scaled(8, 40)),
        *producer.enqueue("test.span", kwargs={"sleep_s": 0.2, "tenant": "b"}, count=scaled(8, 40)),
    ]
    wait_until(
        lambda: len(broker.inspect.queue_stats("default").consumers) == 2, 30, message="two consumers to register"
    )
    time.sleep(1.5)
    assert spans(broker) == [] and broker.inspect.queue_stats("default").paused

    assert broker.control.resume("default")

    def ends() -> list[dict]:
        return [e for e in spans(broker) if e["event"] == "end"]

    wait_until(lambda: len(ends()) >= len(enqueued), scaled(60, 120), interval_s=0.2, message="every task to end")
    events = spans(broker)
    assert sorted(e["task_id"] for e in ends()) == sorted(task.id for task in enqueued)
    for tenant in "ab":
        assert most_at_once([e for e in events if e["tenant"] == tenant]) <= 2
    assert most_at_once(events) > 2  # the tenants ran side by side
    for consumer in consumers:
        assert "CROSSSLOT" not in consumer.log()
        assert consumer.terminate() == 0
