"""The retries a handler asks for: `Retry` after a delay it chooses, `PermanentError` to the dead letters at once."""

from __future__ import annotations

import time

import pytest

from tasks_app import PermanentError, Retry
from tasks_app.consumer.executor import Executor
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import encode_arguments, payload_of
from tasks_app.registry import Handler, Registry
from tests.support.claims import task_bytes
from tests.support.executing import assert_let_go, claimed, dead_tasks, delayed_tasks, make_executor, task_type

pytestmark = pytest.mark.django_db


def retry_in(seconds: float) -> None:
    try:
        raise ConnectionError("upstream says 429")
    except ConnectionError as exc:
        raise Retry(f"upstream busy, back in {seconds} s", in_s=seconds) from exc


def permanent() -> None:
    raise PermanentError("card 4242 was declined for good")


@pytest.fixture
def executor(broker: Broker) -> Executor:
    registry = Registry()
    registry.add(Handler("x.retry_in", retry_in))
    registry.add(Handler("x.permanent", permanent))
    return make_executor(broker, registry)


def test_a_handler_asking_for_a_retry_runs_again_when_it_asked_with_an_attempt_used(broker, executor):
    task_type(executor, "x.retry_in", max_attempts=3, retry_backoff=3600)
    assert executor.execute(claimed(broker, "t1", "x.retry_in", 30)) is False
    assert_let_go(broker)
    [(task, due_in_ms)] = delayed_tasks(broker)
    assert 29_000 <= due_in_ms <= 30_000, "waited its backoff, not the 30 s it asked for"
    assert task.attempt == 1 and task.last_error == "tasks_app.exceptions.Retry: upstream busy, back in 30 s"
    assert "ConnectionError: upstream says 429" in task.last_traceback, "the cause is kept"
    record = broker.records.get_result("t1")
    assert record["status"] == "READY"
    assert 29_000 <= int(record["run_after_ms"]) - time.time() * 1000 <= 30_000, "the record says when it runs again"


def test_a_handler_asking_for_a_retry_on_its_last_attempt_is_dead_lettered(broker, executor):
    task_type(executor, "x.retry_in", max_attempts=2)
    raw = task_bytes("t1", "x.retry_in", payload=payload_of(*encode_arguments([5], {})), attempt=1)
    executor.execute(claimed(broker, "t1", "x.retry_in", raw=raw))
    [dead] = dead_tasks(broker)
    assert dead.dead_reason.startswith("failed 2 of 2 attempts; last error: tasks_app.exceptions.Retry")
    assert delayed_tasks(broker) == []


def test_a_permanent_error_is_dead_lettered_at_once_with_its_attempts_unused(broker, executor):
    task_type(executor, "x.permanent", max_attempts=5)
    assert executor.execute(claimed(broker, "t1", "x.permanent")) is False
    assert_let_go(broker)
    [dead] = dead_tasks(broker)
    assert dead.attempt == 1 and delayed_tasks(broker) == []
    assert dead.dead_reason == (
        "permanent error on attempt 1: tasks_app.exceptions.PermanentError: card 4242 was declined for good"
    )
    record = broker.records.get_result("t1")
    assert record["status"] == "FAILED" and record["dead_reason"] == dead.dead_reason
