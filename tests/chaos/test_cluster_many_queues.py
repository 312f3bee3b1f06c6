"""A consumer on many queues of a Redis Cluster: every primary tells it of changes, so its threads do not grow
with the queues, a task on any queue starts at once while it idles, and idle it polls nothing."""

from __future__ import annotations

import time

import pytest
import redis

from tests.integration.test_many_queues import assert_picked_up_at_once, threads_of
from tests.support.processes import wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True), pytest.mark.alone]

QUEUES = [f"spread{index}" for index in range(40)]


def registered(broker, queues: list[str]) -> bool:
    return all(broker.inspect.queue_stats(queue).consumers for queue in (queues[0], queues[-1]))


def commands_per_s(broker, window_s: float) -> float:
    """Commands the cluster's primaries ran per second over `window_s` (scripts' own calls included)."""
    primaries = [redis.Redis(host=node.host, port=node.port) for node in broker.client.get_primaries()]

    def total() -> int:
        return sum(
            stats["calls"]
            for node in primaries
            for name, stats in node.info("commandstats").items()
            if "info" not in name
        )

    before = total()
    time.sleep(window_s)
    return (total() - before) / window_s


@pytest.mark.timeout(240)
def test_a_consumer_on_forty_queues_of_a_cluster_keeps_its_threads_and_starts_each_task_at_once(
    cluster_broker, consumer_process
):
    broker = cluster_broker
    nodes = {broker.client.get_node_from_key(broker.keys.pending(queue)).name for queue in QUEUES}
    assert len(nodes) == 3, "the queues spread over every primary"
    threads = {}
    for queues in (QUEUES[:2], QUEUES):
        consumer = consumer_process("--concurrency", "2", *[arg for queue in queues for arg in ("--queue", queue)])
        wait_until(
            lambda queues=queues: registered(broker, queues), 60, message=lambda consumer=consumer: consumer.log()
        )
        time.sleep(3)  # past every loop's first pass
        threads[len(queues)] = threads_of(consumer.pid)
        if len(queues) == 2:
            assert consumer.terminate(timeout_s=60) == 0, consumer.log()
    assert threads[len(QUEUES)] == threads[2], threads

    idle = commands_per_s(broker, 5.0)
    print(f"\nCLUSTER {len(QUEUES)} queues: threads {threads}, idle {idle:.1f} commands/s")
    assert idle < 3 * len(QUEUES), f"an idle consumer on {len(QUEUES)} queues ran {idle:.0f} commands/s"

    assert_picked_up_at_once(broker, consumer, QUEUES)
