"""Every outcome of running one claimed task, settled in a real Redis."""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import OperationalError

from tasks_app.consumer.ack_batcher import AckBatcher
from tasks_app.consumer.claiming import Claimed
from tasks_app.consumer.executor import Executor
from tasks_app.context import TaskContext, current
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.keys import UNDECODABLE_TYPE
from tasks_app.registry import Handler, Registry
from tests.support.claims import claim, push, register, task_bytes
from tests.support.counters import sample
from tests.support.executing import (
    CONSUMER,
    assert_let_go,
    claimed,
    dead_tasks,
    delayed_tasks,
    executor_of,
    make_executor,
    task_type,
)
from tests.support.odd_values import (
    AsyncAdder,
    ExitsWhenListed,
    Unlistable,
    raises_an_error_that_exits_when_shown,
)

pytestmark = pytest.mark.django_db


def boom() -> None:
    raise ValueError("boom")


def with_context(context: TaskContext, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return {
        "task_id": context.task_id,
        "attempt": context.attempt,
        "max_attempts": context.max_attempts,
        "queue": context.queue,
        "consumer": context.consumer_id,
        "args": list(args),
        "kwargs": kwargs,
    }


@pytest.fixture
def registry() -> Registry:
    """Handlers of this module only."""
    registry = Registry()
    registry.add(Handler("x.add", lambda a, b: a + b))
    registry.add(Handler("x.boom", boom))
    registry.add(Handler("x.context", with_context, takes_context=True))
    registry.add(Handler("x.current", lambda *args: with_context(current(), *args)))
    registry.add(Handler("x.exit", lambda: exec("raise SystemExit(3)")))
    registry.add(Handler("x.not_json", lambda: object()))
    registry.add(Handler("x.too_deep", lambda: functools.reduce(lambda inner, _: [inner], range(100_000), [])))
    registry.add(Handler("x.unlistable", lambda: Unlistable(a=1)))
    registry.add(Handler("x.sleep", lambda seconds: time.sleep(seconds) or "late"))
    registry.add(Handler("x.exits_when_listed", lambda: ExitsWhenListed(a=1)))
    registry.add(Handler("x.exits_when_shown", raises_an_error_that_exits_when_shown))
    registry.add(Handler("x.async_callable", AsyncAdder()))
    registry.add(Handler("x.wraps_async", lambda a, b: AsyncAdder()(a, b)))
    return registry


@pytest.fixture
def executor(broker: Broker, registry: Registry) -> Iterator[Executor]:
    executor = make_executor(broker, registry)
    yield executor
    executor.async_lane.close()


# --- tasks that cannot run ----------------------------------------------------------------
def test_undecodable_bytes_are_kept_in_a_dead_wrapper(broker, executor):
    item = claimed(broker, "", "", raw=b"\xff\x00 not a task")
    assert executor.execute(item) is False
    assert_let_go(broker)
    [wrapper] = dead_tasks(broker)
    assert wrapper.type == UNDECODABLE_TYPE and wrapper.payload == b"\xff\x00 not a task"
    assert wrapper.dead_reason.startswith("undecodable task")


def test_an_unknown_type_is_dead_lettered_without_an_attempt(broker, executor):
    item = claimed(broker, "t1", "nobody.knows")
    before = sample("taskqueue_tasks_dead_lettered_total", queue="q")  # under whatever type label
    assert executor.execute(item) is False
    assert_let_go(broker)
    [dead] = dead_tasks(broker)
    assert dead.id == "t1" and dead.attempt == 0 and "unknown task type 'nobody.knows'" in dead.dead_reason
    assert dead.last_error.startswith("UnknownTaskType:")
    record = broker.records.get_result("t1")
    assert record["status"] == "FAILED" and "unknown task type" in record["dead_reason"]
    assert sample("taskqueue_tasks_dead_lettered_total", queue="q") == before + 1


def test_unknown_tasks_claimed_together_read_the_task_types_once_not_once_each(broker, executor, monkeypatch):
    for i in range(5):
        push(broker, task_bytes(f"t{i}", "nobody.knows"))
    batch = [Claimed("q", CONSUMER, raw) for raw in claim(broker, CONSUMER, 5)]
    reads: list[float] = []
    refresh = executor.task_types.refresh
    monkeypatch.setattr(executor.task_types, "refresh", lambda: reads.append(time.monotonic()) or refresh())
    for item in batch:
        executor.execute(item)
    assert len(dead_tasks(broker)) == 5 and len(reads) == 1, "a flood of them costs a query per claim"


def test_a_row_whose_handler_is_not_registered_is_dead_lettered_with_the_import_errors(broker, executor, registry):
    task_type(executor, "x.orphan", handler="gone.module.handler")
    registry.import_modules(["tests.support.broken_handlers"])
    assert executor.execute(claimed(broker, "t1", "x.orphan")) is False
    assert_let_go(broker)
    [dead] = dead_tasks(broker)
    assert "handler 'gone.module.handler' of task type 'x.orphan' is not registered" in dead.dead_reason
    assert "tests.support.broken_handlers" in dead.dead_reason
    assert dead.last_error.startswith("HandlerNotRegistered:")


@pytest.mark.parametrize("payload", [b"{nope", b'{"args":' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_a_payload_that_is_not_json_is_dead_lettered(broker, executor, payload):
    assert executor.execute(claimed(broker, "t1", "x.add", raw=task_bytes("t1", "x.add", payload=payload))) is False
    assert_let_go(broker)
    [dead] = dead_tasks(broker)
    assert dead.last_error.startswith("InvalidPayload:") and dead.attempt == 0


# --- deferrals ----------------------------------------------------------------------------
def test_a_disabled_type_waits_in_delayed_without_using_an_attempt(broker, executor):
    task_type(executor, "x.add", enabled=False)
    item = claimed(broker, "t1", "x.add", 1, 2)
    before = sample("taskqueue_tasks_deferred_total", type="x.add", queue="q", reason="disabled")
    assert executor.execute(item) is False
    assert_let_go(broker)
    [(task, due_in_ms)] = delayed_tasks(broker)
    assert task.id == "t1" and task.attempt == 0
    assert 299_000 <= due_in_ms <= 300_000  # looked at again in five minutes, or woken when enabled
    [member] = broker.client.zrange(broker.keys.delayed("q"), 0, -1)
    assert broker.client.smembers(broker.keys.disabled("q", "x.add")) == {member}  # noted for its wake-up
    assert broker.client.smembers(broker.keys.disabled_types("q")) == {b"x.add"}
    assert broker.records.get_result("t1") is None, "nothing ran, nothing was recorded"
    assert sample("taskqueue_tasks_deferred_total", type="x.add", queue="q", reason="disabled") == before + 1


def test_a_rate_limited_type_runs_one_then_defers_the_next_to_its_slot(broker, executor):
    task_type(executor, "x.add", rate_limit=1, rate_period=10)
    assert executor.execute(claimed(broker, "t1", "x.add", 1, 2)) is True
    assert broker.records.get_result("t1")["status"] == "SUCCESSFUL"
    assert executor.execute(claimed(broker, "t2", "x.add", 3, 4)) is False
    assert_let_go(broker)
    [(task, due_in_ms)] = delayed_tasks(broker)
    assert task.id == "t2" and task.attempt == 0
    assert 8000 <= due_in_ms <= 10_500
    assert sample("taskqueue_tasks_deferred_total", type="x.add", queue="q", reason="rate_limited") >= 1


# --- runs ---------------------------------------------------------------------------------
def test_a_handler_without_context_reads_its_run_from_current_which_is_unset_outside_runs(broker, executor):
    executor.execute(claimed(broker, "t1", "x.current", "a"))
    value = json.loads(broker.records.get_result("t1")["return_value"])
    assert (value["task_id"], value["attempt"], value["args"]) == ("t1", 1, ["a"])
    with pytest.raises(LookupError, match="only available while a consumer runs a task"):
        current()


def test_a_successful_run_is_acked_with_its_return_value(broker, executor):
    before = sample("taskqueue_tasks_succeeded_total", type="x.add", queue="q")
    assert executor.execute(claimed(broker, "t1", "x.add", 2, 3)) is True
    assert_let_go(broker)
    record = broker.records.get_result("t1")
    assert record["status"] == "SUCCESSFUL" and json.loads(record["return_value"]) == 5
    assert record["attempts"] == "1" and json.loads(record["worker_ids"]) == [CONSUMER]
    assert dead_tasks(broker) == [] and delayed_tasks(broker) == []
    assert sample("taskqueue_tasks_succeeded_total", type="x.add", queue="q") == before + 1


@pytest.mark.parametrize("handler", ["x.async_callable", "x.wraps_async"])
def test_a_coroutine_from_an_async_callable_object_or_a_plain_wrapper_is_run_to_its_value(broker, executor, handler):
    assert executor.registry.get("x.async_callable").is_async  # on the asyncio lane; the wrapper on this thread
    settled = threading.Event()
    assert executor.execute(claimed(broker, "t1", handler, 2, 3), on_settled=settled.set) is True
    assert settled.wait(5)
    record = broker.records.get_result("t1")
    assert record["status"] == "SUCCESSFUL" and json.loads(record["return_value"]) == 5


def test_a_task_whose_lease_was_lost_at_the_gates_is_left_to_the_reaper_unstarted(broker, executor):
    asked: list[Claimed] = []
    executor.lease_check = lambda item: bool(asked.append(item))  # the lease was lost meanwhile
    item = claimed(broker, "t1", "x.add", 2, 3)
    assert executor.execute(item) is False and asked == [item]
    assert broker.queue.held_by("q", CONSUMER) == [item.raw]  # the reaper recovers it
    assert broker.records.get_result("t1") is None  # no start was recorded


def test_a_handler_with_context_sees_this_run(broker, executor):
    task_type(executor, "x.context", max_attempts=4)
    executor.execute(claimed(broker, "t1", "x.context", "a"))
    value = json.loads(broker.records.get_result("t1")["return_value"])
    assert value == {
        "task_id": "t1",
        "attempt": 1,
        "max_attempts": 4,
        "queue": "q",
        "consumer": CONSUMER,
        "args": ["a"],
        "kwargs": {},
    }


def test_a_failure_is_retried_later_with_backoff_and_the_error(broker, executor):
    task_type(executor, "x.boom", max_attempts=3, retry_backoff=10)
    assert executor.execute(claimed(broker, "t1", "x.boom")) is False
    assert_let_go(broker)
    [(task, due_in_ms)] = delayed_tasks(broker)
    assert task.attempt == 1 and task.last_error == "builtins.ValueError: boom"
    assert "ValueError: boom" in task.last_traceback
    assert 4500 <= due_in_ms <= 10_000  # the upper half of base * 2^0
    record = broker.records.get_result("t1")
    assert record["status"] == "READY" and record["attempts"] == "1"
    assert json.loads(record["errors"])[0]["exception_class_path"] == "builtins.ValueError"


def test_the_second_retry_waits_about_twice_as_long(broker, executor):
    task_type(executor, "x.boom", max_attempts=3, retry_backoff=10)
    executor.execute(claimed(broker, "t1", "x.boom", raw=task_bytes("t1", "x.boom", attempt=1)))
    [(task, due_in_ms)] = delayed_tasks(broker)
    assert task.attempt == 2 and 9500 <= due_in_ms <= 20_000


def test_the_last_failure_dead_letters_with_the_reason(broker, executor):
    task_type(executor, "x.boom", max_attempts=2)
    assert executor.execute(claimed(broker, "t1", "x.boom", raw=task_bytes("t1", "x.boom", attempt=1))) is False
    assert_let_go(broker)
    [dead] = dead_tasks(broker)
    assert dead.attempt == 2
    assert dead.dead_reason == "failed 2 of 2 attempts; last error: builtins.ValueError: boom"
    record = broker.records.get_result("t1")
    assert record["status"] == "FAILED" and record["dead_reason"] == dead.dead_reason


def test_the_task_s_own_max_attempts_wins_over_its_type(broker, executor):
    task_type(executor, "x.boom", max_attempts=5)
    executor.execute(claimed(broker, "t1", "x.boom", max_attempts=1))
    assert [task.id for task in dead_tasks(broker)] == ["t1"] and delayed_tasks(broker) == []


@pytest.mark.parametrize(("attempt", "counted"), [(-5, 1), (2**31 - 1, 2**31 - 1)])
def test_a_foreign_attempt_count_out_of_range_still_counts_the_run(broker, executor, attempt, counted):
    task_type(executor, "x.boom", max_attempts=1)
    executor.execute(claimed(broker, "t1", "x.boom", raw=task_bytes("t1", "x.boom", attempt=attempt)))
    [dead] = dead_tasks(broker)
    assert dead.attempt == counted and dead.dead_reason.startswith(f"failed {counted} of 1 attempts")


@pytest.mark.parametrize(
    ("handler", "error"),
    [
        ("x.exit", "builtins.SystemExit: 3"),
        ("x.not_json", "ResultNotJson"),
        ("x.too_deep", "ResultNotJson"),
        ("x.unlistable", "ResultNotJson: return value is not JSON-serializable: items unavailable"),
        ("x.exits_when_listed", "ResultNotJson: return value is not JSON-serializable: 4"),
        ("x.exits_when_shown", "ExitsWhenShown: <ExitsWhenShown whose message cannot be shown>"),
    ],
)
def test_a_handler_that_exits_or_returns_non_json_fails_its_task(broker, executor, handler, error):
    task_type(executor, handler, max_attempts=1)
    executor.execute(claimed(broker, "t1", handler))
    [dead] = dead_tasks(broker)
    assert error in dead.last_error


def test_an_outcome_for_a_task_no_longer_held_counts_an_ack_lost(broker, executor):
    item = claimed(broker, "t1", "x.add", 1, 1)
    broker.client.delete(broker.keys.processing("q", CONSUMER))  # reaped meanwhile
    before = sample("taskqueue_acks_lost_total", queue="q")
    assert executor.execute(item) is True
    assert sample("taskqueue_acks_lost_total", queue="q") == before + 1


def test_a_suspect_has_its_start_recorded_before_its_handler_runs(broker, registry):
    seen: list[bool] = []
    register(broker, CONSUMER, lease_ms=30_000)
    executor = executor_of(broker, registry, CONSUMER)
    item = claimed(broker, "t1", "x.probe")

    def probe() -> None:
        # The reaper counts a death against a suspect only if this mark exists.
        seen.append(bool(broker.client.hlen(broker.keys.recoveries("q"))))

    registry.add(Handler("x.probe", probe))
    executor.execute(Claimed(item.queue, item.consumer_id, item.raw, suspect=True))
    assert seen == [True]


# --- with the ack batcher -----------------------------------------------------------------
@pytest.fixture
def batched(broker: Broker, registry: Registry) -> Iterator[Executor]:
    register(broker, CONSUMER, lease_ms=30_000)
    acks = AckBatcher(broker, threading.Event())
    acks.start()
    yield executor_of(broker, registry, CONSUMER, acks=acks)
    acks.close(timeout_s=5)


def test_with_the_batcher_a_success_is_settled_later_and_reported(broker, batched):
    settled = threading.Event()
    assert batched.execute(claimed(broker, "t1", "x.add", 1, 2), on_settled=settled.set) is True
    assert settled.wait(5), "on_settled was called once the ack was written"
    assert broker.records.get_result("t1")["status"] == "SUCCESSFUL"
    assert_let_go(broker)


def test_with_the_batcher_a_failure_is_settled_at_once(broker, batched):
    batched.task_types.refresh()
    assert batched.execute(claimed(broker, "t1", "x.boom"), on_settled=lambda: pytest.fail("not batched")) is False
    assert_let_go(broker)
    [(task, _)] = delayed_tasks(broker)
    assert task.attempt == 1
    record = broker.records.get_result("t1")
    assert record["status"] == "READY" and record["attempts"] == "1"


# --- timeouts -----------------------------------------------------------------------------
def test_expire_overdue_fails_a_run_past_its_timeout_and_ignores_its_late_return(broker, executor):
    task_type(executor, "x.sleep", max_attempts=1, timeout=0.1)
    item = claimed(broker, "t1", "x.sleep", 0.4)
    worker = threading.Thread(target=executor.execute, args=(item,))
    worker.start()
    assert executor.time_limits.expire_overdue() == 0, "not overdue yet"
    time.sleep(0.2)
    assert executor.time_limits.expire_overdue() == 1
    assert executor.time_limits.expire_overdue() == 0, "failed once"
    worker.join(timeout=5)
    assert_let_go(broker)
    [dead] = dead_tasks(broker)
    assert "TaskTimeout" in dead.last_error and "timeout of 0.1 s" in dead.last_error
    record = broker.records.get_result("t1")
    assert record["status"] == "FAILED" and "return_value" not in record, "the late return was not applied"


def test_a_task_waits_while_the_task_types_were_never_read(broker, executor, monkeypatch):
    TaskType.objects.create(name="x.add", handler="x.add", queue="q", rate_limit=1, rate_period=3600)
    rows = TaskType.objects.all

    def database_down() -> None:
        raise OperationalError("the database is restarting")

    monkeypatch.setattr(TaskType.objects, "all", database_down)  # down since the consumer started
    assert executor.execute(claimed(broker, "t1", "x.add", 1, 2)) is False
    assert_let_go(broker)
    [(task, due_in_ms)] = delayed_tasks(broker)  # not run with the defaults, which have no rate limit
    assert task.id == "t1" and task.attempt == 0 and 4000 <= due_in_ms <= 5000
    assert broker.records.get_result("t1") is None and dead_tasks(broker) == []

    monkeypatch.setattr(TaskType.objects, "all", rows)  # back: the row's limit holds
    executor.task_types.refresh()  # the housekeeping refresh (claims wait a second after a failed read)
    executor.execute(claimed(broker, "t2", "x.add", 1, 2))
    executor.execute(claimed(broker, "t3", "x.add", 3, 4))
    assert broker.records.get_result("t2")["status"] == "SUCCESSFUL"
    assert broker.records.get_result("t3") is None, "the second start within the hour waits for its slot"
