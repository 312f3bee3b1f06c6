"""An idle consumer's scheduler sends Redis nothing, yet starts a delayed task on time, even one due
sooner than every task delayed before it."""

import time

import pytest

from tasks_app import producer
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.alone]

# A generous bound for a start after its due time (a few ms on a quiet machine).
LATE_BOUND_MS = 100


def start_after_due_ms(broker, delay_s: float) -> float:
    """Enqueue a delayed task; how long after its due time (on the Redis clock) its handler started."""
    seconds, micros = broker.client.time()
    due_ms = seconds * 1000 + micros / 1000 + delay_s * 1000
    (task,) = producer.enqueue("test.record", delay_s=delay_s)
    wait_until(
        lambda: any(run["task_id"] == task.id for run in recorded_runs(broker)),
        delay_s + 10,
        message="the delayed task to start",
    )
    return next(run["start_ms"] for run in recorded_runs(broker) if run["task_id"] == task.id) - due_ms


def test_a_delayed_task_starts_on_time_on_an_idle_consumer(broker, consumer_process):
    consumer = consumer_process("--concurrency", "2")
    wait_until(lambda: broker.inspect.queue_stats("default").consumers, 30, message="the consumer to register")
    time.sleep(1)
    producer.enqueue("test.record", delay_s=60)  # due long after the next: the scheduler must not sleep till then
    late_ms = [start_after_due_ms(broker, delay_s) for delay_s in (0.3, 0.5, 0.3)]
    assert all(-1 <= late <= LATE_BOUND_MS for late in late_ms), (late_ms, consumer.log())
