"""The automatic prefetch with real `runconsumer` processes: slow tasks are not hoarded by one consumer."""

import time

import pytest

from tasks_app import producer
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs

pytestmark = pytest.mark.django_db(transaction=True)


def held(broker, consumer_id: str) -> int:
    return broker.client.llen(broker.keys.processing("default", consumer_id))


def test_a_busy_consumer_of_slow_tasks_leaves_the_rest_to_a_consumer_that_joins_later(broker, consumer_process):
    first = consumer_process("--concurrency", "2", "--consumer-id", "first")
    wait_until(
        lambda: len(broker.inspect.queue_stats("default").consumers) == 1, 30, message="the first consumer to register"
    )
    # 6 s of work for the first alone: a second consumer starting slowly (a loaded machine) still finds some.
    tasks = producer.enqueue("test.record", kwargs={"sleep_s": 0.4}, count=30)
    wait_until(lambda: len(recorded_runs(broker)) >= 2, 20, message="the first consumer to start two")
    most_held = held(broker, "first")
    second = consumer_process("--concurrency", "2", "--consumer-id", "second")
    deadline = time.monotonic() + 30
    while len(recorded_runs(broker)) < len(tasks) and time.monotonic() < deadline:
        most_held = max(most_held, held(broker, "first"))
        time.sleep(0.02)
    runs = recorded_runs(broker)
    assert sorted(run["task_id"] for run in runs) == sorted(task.id for task in tasks), "each ran once"
    assert most_held <= 2, f"a consumer of 0.4 s tasks prefetched: it held {most_held} with 2 threads"
    by_consumer = {run["consumer"] for run in runs}
    assert {"first", "second"} <= by_consumer, [first.log(), second.log()]
