"""A consumer over keys of the right type holding values no version of ours writes ("nan", "inf", 1e400, 2^64):
each is read as documented or as absent, and no task is lost, held for ever or let past its limit."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tasks_app import producer
from tasks_app.consumer.gates import RateLimiter
from tasks_app.consumer.membership import ReaperLoop, pid_namespace
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task
from tests.integration.test_rate_follow_ups import LIMITED, TYPE
from tests.support import django_tasks
from tests.support.claims import claim, push, register, task_bytes
from tests.support.processes import wait_until
from tests.support.recording import runs_per_task
from tests.test_backends import redis_tasks  # noqa: F401  (a fixture)

pytestmark = pytest.mark.django_db(transaction=True)

# Numbers no token, time or lease of ours can be: not a number at all, or past 2^53, where doubles skip integers.
NOT_WHOLE = ["nan", "inf", "1e400", "1e30", "18446744073709551616"]
SHORT_LEASE_MS = 100


def _dies_holding(broker: Broker, consumer_id: str, task_id: str, queue: str = "q") -> None:
    """A consumer of `queue` that claimed one task and whose lease then lapsed."""
    push(broker, task_bytes(task_id, queue=queue), queue=queue)
    register(broker, consumer_id, SHORT_LEASE_MS, queue)
    claim(broker, consumer_id, 1, queue)


def _reaper(broker: Broker, queues: list[str]) -> ReaperLoop:
    return ReaperLoop(broker, queues, SHORT_LEASE_MS / 1000, lambda queue, dead: None)


def _succeeded(broker: Broker, task_ids: list[str]) -> bool:
    return all(broker.client.hget(broker.keys.result(task_id), "status") == b"SUCCESSFUL" for task_id in task_ids)


@pytest.mark.parametrize("value", NOT_WHOLE)
def test_a_fence_counter_that_is_no_whole_number_counts_as_lost_and_every_task_runs_once(
    broker, consumer_in_thread, value
):
    broker.client.set(broker.keys.fence("q"), value)
    ids = [producer.enqueue("test.record", queue="q")[0].id for _ in range(3)]
    with consumer_in_thread(queues=["q"]):
        # Before: the claim's tokens came back as -2^63 (or all one number), every receipt was refused as a
        # later claim's, and the tasks were acked unrun: lost.
        wait_until(lambda: _succeeded(broker, ids), 15, message="the tasks to succeed")
    assert runs_per_task(broker) == dict.fromkeys(ids, 1)
    assert int(broker.client.get(broker.keys.fence("q"))) > broker.server_time_ms() * 1000 - 60_000_000


@pytest.mark.parametrize("value", ["inf", "1e400", "18446744073709551616"])
def test_a_records_fence_that_is_no_whole_number_holds_back_no_run(broker, consumer_in_thread, value):
    [task] = producer.enqueue("test.record", queue="q")
    broker.client.hset(broker.keys.result(task.id), "fence", value)
    with consumer_in_thread(queues=["q"]):
        # Before: every token was below it, so the receipt said a later claim held the task: acked unrun.
        wait_until(lambda: _succeeded(broker, [task.id]), 15, message="the task to succeed")
    assert runs_per_task(broker) == {task.id: 1}


@pytest.mark.parametrize("lease", ["1e400", '"inf"', "1e15"])
def test_a_dead_consumers_lease_that_is_no_lease_holds_off_no_reaping(broker, lease):
    _dies_holding(broker, "dead", "t1")
    broker.client.hset(broker.keys.consumer_info("q"), "dead", f'{{"lease_ms": {lease}}}')
    time.sleep(SHORT_LEASE_MS / 1000 + 0.02)
    # Before: the reaper held off until Redis had been up for that "lease" (for ever, or 31 years).
    _reaper(broker, ["q"]).run_once()
    assert broker.held_by("q", "dead") == [] and broker.client.llen(broker.keys.suspects("q")) == 1


@pytest.mark.parametrize("pid", [2**31, 2**70])
def test_a_holder_of_this_host_whose_pid_no_process_can_have_is_gone(broker, consumer_in_thread, pid):
    info = {"host": socket.gethostname(), "pid_ns": pid_namespace(), "pid": pid, "lease_ms": 60_000}
    broker.client.zadd(broker.keys.consumers("q"), {"fixed": broker.server_time_ms() + 60_000})
    broker.client.hset(broker.keys.consumer_info("q"), "fixed", json.dumps(info))
    [task] = producer.enqueue("test.record", queue="q")
    # Before: os.kill raised OverflowError and the consumer crashed as it started.
    with consumer_in_thread(queues=["q"], consumer_id="fixed"):
        wait_until(lambda: _succeeded(broker, [task.id]), 15, message="the task to succeed")


@pytest.mark.parametrize("field", ["tat", "cursor", "r:t2"])
@pytest.mark.parametrize("value", ["1e300", "18446744073709551616"])
def test_a_rate_limiters_time_past_any_clock_counts_as_absent_and_the_limit_holds(broker, field, value):
    broker.client.hset(broker.keys.rate(TYPE), field, value)
    limiter = RateLimiter(broker)
    first = limiter(Task(id="t1", type=TYPE, queue="q"), LIMITED, None)
    second = limiter(Task(id="t2", type=TYPE, queue="q"), LIMITED, None)
    # Before: the wait overflowed the reply to -2^63, which reads as admitted: every task started at once.
    assert first.wait_ms == 0
    assert 0 < second.wait_ms <= LIMITED.rate_period_s * 1000 * 1.1


@pytest.mark.parametrize("score", [float("inf"), 1e300])
def test_a_keyed_limits_value_noted_for_ever_keeps_no_other_value_from_being_noted(broker, score):
    broker.client.zadd(broker.keys.rate_keyed(TYPE), {"foreign": score})
    # Before: its expiry was no integer to Redis, and every note failed: no change reached those values' tasks.
    assert broker.rate_keyed(TYPE, "k1", 1_000_000, 100) == 1
    assert broker.client.zscore(broker.keys.rate_keyed(TYPE), "k1") is not None


@pytest.mark.usefixtures("redis_tasks")
@pytest.mark.parametrize("errors", ['[{"exception_class_path": "x.Error"}]', '[{"traceback": "t"}]', "[{}]"])
def test_a_django_task_records_error_missing_a_field_reads_with_that_field_empty(broker, errors):
    result = django_tasks.add.enqueue(1, 2)
    broker.client.hset(broker.keys.result(result.id), mapping={"status": "FAILED", "errors": errors})
    [error] = django_tasks.add.get_result(result.id).errors  # before: KeyError
    assert {error.exception_class_path, error.traceback} <= {"x.Error", "t", ""}
