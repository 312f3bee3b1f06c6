"""Time limits hold while the consumer cannot reach Redis (cut off, or frozen): they wait on no Redis reply."""

from __future__ import annotations

import threading
import time

import pytest

from tasks_app import producer
from tasks_app.consumer.lifecycle import Consumer
from tasks_app.consumer.options import ConsumerOptions
from tasks_app.consumer.supervisor import EXIT_HARD_LIMIT
from tasks_app.exceptions import TaskTimeout
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.records import ResultRecord
from tasks_app.protocol.scripts import connect
from tasks_app.registry import Handler, Registry
from tests.support.consumers import running
from tests.support.proxy import RedisProxy

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT_S = 2.0


class Interruptible:
    """A handler sleeping in pure Python (a TaskTimeout lands between two sleeps) that notes how it ended."""

    def __init__(self, seconds: float) -> None:
        self.started, self.ended = threading.Event(), threading.Event()
        self.seen: list[BaseException] = []
        self.steps = int(seconds / 0.05)

    def __call__(self) -> None:
        self.started.set()
        try:
            for _ in range(self.steps):
                time.sleep(0.05)
        except TaskTimeout as exc:
            self.seen.append(exc)
            raise
        finally:
            self.ended.set()


@pytest.mark.alone  # how late the timeout lands is what it checks: load elsewhere would delay it
@pytest.mark.parametrize("outage", ["cut", "freeze"])
def test_a_timeout_is_raised_in_its_handler_on_time_while_redis_is_unreachable(broker, outage):
    sleepy = Interruptible(10)
    registry = Registry()
    registry.add(Handler("x.sleepy", sleepy))
    TaskType.objects.create(name="x.sleepy", handler="x.sleepy", timeout=TIMEOUT_S, max_attempts=1)
    producer.enqueue_many([producer.TaskRequest("x.sleepy")], registry=registry)
    proxy = RedisProxy(broker.client.connection_pool.connection_kwargs["port"])
    try:
        # Claims, results and cancel checks through the proxy (a frozen server answers none of
        # them for 5 s); the lease on a connection of its own.
        consumer = Consumer(
            ConsumerOptions(concurrency=1, prefetch=0, lease_s=10.0, block_s=0.2),
            registry=registry,
            broker=Broker(connect(proxy.url, timeout_s=5.0), broker.keys.prefix),
        )
        with running(consumer):
            assert sleepy.started.wait(10), "the task did not start"
            started_at = time.monotonic()
            proxy.cut() if outage == "cut" else proxy.freeze()
            assert sleepy.ended.wait(TIMEOUT_S + 10), "the handler was never interrupted"
            late_s = time.monotonic() - started_at - TIMEOUT_S
            proxy.restore()
            proxy.thaw()
        assert sleepy.seen and late_s < 0.6, f"TaskTimeout came {late_s:.2f} s late, with Redis {outage}"
    finally:
        proxy.close()


@pytest.mark.alone  # how late the timeout lands is what it checks: load elsewhere would delay it
def test_a_hard_limit_settling_during_a_frozen_redis_delays_no_other_runs_timeout(broker):
    # Process mode's hard limit gives up on a run hung in C; its failure cannot be written while
    # Redis is frozen. Another run's TaskTimeout must land on time all the same.
    stuck_started = threading.Event()
    sleepy = Interruptible(20)

    def stuck() -> None:
        stuck_started.set()
        time.sleep(30)  # in C: no TaskTimeout can land; only the hard limit ends it

    registry = Registry()
    registry.add(Handler("x.stuck", stuck))
    registry.add(Handler("x.sleepy", sleepy))
    TaskType.objects.create(name="x.stuck", handler="x.stuck", timeout=1, max_attempts=1)
    TaskType.objects.create(name="x.sleepy", handler="x.sleepy", timeout=4, max_attempts=1)
    stuck_id = producer.enqueue_many(
        [producer.TaskRequest("x.stuck"), producer.TaskRequest("x.sleepy")], registry=registry
    )[0].id
    proxy = RedisProxy(broker.client.connection_pool.connection_kwargs["port"])
    try:
        consumer = Consumer(
            ConsumerOptions(concurrency=2, prefetch=0, lease_s=30.0, block_s=0.2, grace_s=10, hard_limit_grace_s=0.5),
            registry=registry,
            broker=Broker(connect(proxy.url, timeout_s=5.0), broker.keys.prefix),
        )
        with running(consumer, exit_code=EXIT_HARD_LIMIT):  # it leaves once the stuck run is given up on
            assert stuck_started.wait(10) and sleepy.started.wait(10), "the tasks did not start"
            started_at = time.monotonic()
            proxy.freeze()  # before the stuck run's hard limit (1.5 s): its failure cannot be written
            assert sleepy.ended.wait(20), "the other handler was never interrupted"
            late_s = time.monotonic() - started_at - 4
            proxy.thaw()
        assert sleepy.seen and late_s < 0.6, f"TaskTimeout came {late_s:.2f} s late, behind the hard limit's settling"
        stuck_record = ResultRecord.from_fields(broker.records.get_result(stuck_id))
        assert stuck_record.status == "FAILED" and "TaskTimeout" in stuck_record.errors[-1]["exception_class_path"]
    finally:
        proxy.close()
