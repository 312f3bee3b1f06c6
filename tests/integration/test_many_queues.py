"""A consumer on more queues than it has slots: a task on any of them starts at once while it idles."""

import time

import pytest

from tasks_app import producer
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.alone]

QUEUES = [f"wide{index}" for index in range(50)]
# A generous bound for one idle pick-up (a few ms on a quiet machine): before, tasks waited seconds.
PICK_UP_BOUND_MS = 50


def redis_now_ms(broker) -> float:
    seconds, micros = broker.client.time()
    return seconds * 1000 + micros / 1000


def test_a_task_on_each_of_fifty_queues_starts_at_once_on_an_idle_consumer_of_concurrency_two(broker, consumer_process):
    queue_args = [arg for queue in QUEUES for arg in ("--queue", queue)]
    consumer = consumer_process("--concurrency", "2", "--consumer-id", "wide", *queue_args)
    wait_until(lambda: len(broker.inspect.live_consumers(QUEUES[-1])) == 1, 30, message="the consumer to register")
    time.sleep(3)  # idle past a blocking claim's timeout (2 s), so every queue's wait has cycled once
    waits_ms: dict[str, float] = {}
    for queue in QUEUES:
        enqueued_ms = redis_now_ms(broker)
        (task,) = producer.enqueue("test.record", queue=queue)
        wait_until(
            lambda task=task: any(run["task_id"] == task.id for run in recorded_runs(broker)),
            10,
            message=f"the task on {queue} to start ({consumer.log()})",
        )
        run = next(run for run in recorded_runs(broker) if run["task_id"] == task.id)
        waits_ms[queue] = run["start_ms"] - enqueued_ms
    late = {queue: round(wait_ms, 1) for queue, wait_ms in waits_ms.items() if wait_ms > PICK_UP_BOUND_MS}
    assert not late, f"tasks started more than {PICK_UP_BOUND_MS} ms after their enqueue: {late}"
