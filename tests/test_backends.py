"""RedisBackend: validation, enqueue on commit, results, checks, and Django's behaviour contract."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.db import connection, transaction
from django.tasks import TaskResultStatus, task, task_backends
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.test.utils import CaptureQueriesContext

from tasks_app import producer
from tasks_app.django_tasks.backend import RedisBackend
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker, get_broker
from tasks_app.protocol.codec import decode_task
from tests.support import django_tasks as tasks
from tests.support.processes import wait_until
from tests.support.proxy import RedisProxy

REDIS_BACKEND = {"BACKEND": "tasks_app.backends.RedisBackend", "QUEUES": []}
IMMEDIATE_BACKEND = {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"}


@pytest.fixture
def redis_tasks(settings: Any, key_prefix: str) -> str:
    """TASKS with RedisBackend as default and ImmediateBackend as "immediate", on this test's prefix."""
    settings.TASKS = {"default": REDIS_BACKEND, "immediate": IMMEDIATE_BACKEND}
    return key_prefix


@pytest.fixture
def signals() -> Iterator[list[tuple[str, type, str, str]]]:
    """Every django.tasks signal sent during the test: (signal, sender, task path, status)."""
    sent: list[tuple[str, type, str, str]] = []

    def receiver_for(name: str) -> Any:
        def receive(sender: type, task_result: Any, **kwargs: Any) -> None:
            sent.append((name, sender, task_result.task.module_path, str(task_result.status)))

        return receive

    receivers = {
        "enqueued": receiver_for("enqueued"),
        "started": receiver_for("started"),
        "finished": receiver_for("finished"),
    }
    task_enqueued.connect(receivers["enqueued"])
    task_started.connect(receivers["started"])
    task_finished.connect(receivers["finished"])
    yield sent
    task_enqueued.disconnect(receivers["enqueued"])
    task_started.disconnect(receivers["started"])
    task_finished.disconnect(receivers["finished"])


def redis_keys(broker: Broker) -> list[bytes]:
    """Every key of this test's prefix."""
    return list(broker.client.scan_iter(match=f"{broker.keys.prefix}:*"))


def pending_count(broker: Broker, queue: str = "default") -> int:
    stats = broker.inspect.queue_stats(queue)
    return stats.pending + stats.delayed


def module_level_add(a: int, b: int) -> int:
    return a + b


# --- validation ---------------------------------------------------------------------------
@pytest.mark.django_db
class TestValidation:
    def test_backend_declares_what_it_supports(self, redis_tasks):
        backend = task_backends["default"]
        assert isinstance(backend, RedisBackend)
        assert backend.supports_defer and backend.supports_priority and backend.supports_get_result
        assert backend.supports_async_task

    def test_out_of_range_priority_is_rejected_before_redis(self, redis_tasks, broker):
        for priority in (101, -101):
            with pytest.raises(InvalidTask, match="priority"):
                tasks.add.using(priority=priority).enqueue(1, 2)
        assert redis_keys(broker) == []

    def test_unknown_queue_is_rejected_when_queues_are_listed(self, settings, broker):
        settings.TASKS = {"default": {**REDIS_BACKEND, "QUEUES": ["default", "emails"]}}
        with pytest.raises(InvalidTask, match="Queue 'reports' is not valid"):
            tasks.add.using(queue_name="reports").enqueue(1, 2)
        assert tasks.add.using(queue_name="emails").queue_name == "emails"
        assert redis_keys(broker) == []

    def test_invalid_queue_name_is_rejected(self, redis_tasks, broker):
        with pytest.raises(InvalidTask, match="invalid queue"):
            tasks.add.using(queue_name="no spaces{}").enqueue(1, 2)
        assert redis_keys(broker) == []

    def test_function_not_at_module_level_is_rejected(self, redis_tasks, broker):
        def nested(a: int) -> int:
            return a

        with pytest.raises(InvalidTask, match="module level"):
            task(nested)
        assert task(module_level_add).module_path == f"{__name__}.module_level_add"
        assert redis_keys(broker) == []

    def test_naive_run_after_is_rejected_with_use_tz(self, redis_tasks, broker, settings):
        assert settings.USE_TZ
        with pytest.raises(InvalidTask, match="aware"):
            tasks.add.using(run_after=datetime.now() + timedelta(minutes=1)).enqueue(1, 2)
        assert redis_keys(broker) == []

    def test_producer_rejections_become_invalid_task(self, redis_tasks, broker, settings):
        settings.TASKS_MAX_PAYLOAD_BYTES = 100
        with pytest.raises(InvalidTask, match="over the limit"):
            tasks.echo.enqueue("x" * 200)
        assert redis_keys(broker) == []

    def test_arguments_the_handler_would_not_get_as_given_are_rejected(self, redis_tasks, broker):
        deep: list = [0]
        for _ in range(64):
            deep = [deep]
        with pytest.raises(InvalidTask, match="nest at most 64 levels"):
            tasks.echo.enqueue(deep)
        with pytest.raises(InvalidTask, match="keys must be strings"):
            tasks.echo.enqueue(counts={1: "one"})
        assert redis_keys(broker) == []

    def test_arguments_nested_past_pythons_recursion_limit_are_rejected_as_too_deep(self, redis_tasks, broker):
        deep: list = [0]
        for _ in range(5000):  # Django's normalisation of the arguments recurses once per level
            deep = [deep]
        endless: list = []
        endless.append(endless)
        for args, kwargs in (((deep,), {}), ((), {"value": {"deep": deep}}), ((endless,), {})):
            with pytest.raises(InvalidTask, match="nest at most 64 levels"):
                tasks.echo.enqueue(*args, **kwargs)
        assert redis_keys(broker) == []

    def test_arguments_that_are_not_json_fail_as_in_django(self, redis_tasks, broker):
        with pytest.raises(TypeError):
            tasks.add.enqueue(object(), 1)
        with pytest.raises(TypeError):
            tasks.add.using(backend="immediate").enqueue(object(), 1)
        assert redis_keys(broker) == []


# --- enqueue, on commit, results --------------------------------------------------------------
@pytest.mark.django_db(transaction=True)
class TestEnqueue:
    def test_enqueue_pushes_at_once_outside_a_transaction(self, redis_tasks, broker, signals):
        result = tasks.add.enqueue(2, 3)

        assert str(uuid.UUID(result.id)) == result.id
        assert result.status == TaskResultStatus.READY and result.enqueued_at is not None
        assert pending_count(broker) == 1
        assert signals == [("enqueued", RedisBackend, tasks.add.module_path, "READY")]
        stored = tasks.add.get_result(result.id)
        assert (stored.status, stored.args, stored.kwargs, stored.attempts) == ("READY", [2, 3], {}, 0)
        row = TaskType.objects.get(name=tasks.add.module_path)
        assert row.handler == tasks.add.module_path

    def test_its_fresh_ids_are_pushed_unchecked_under_the_results_id(self, redis_tasks, broker):
        later = datetime.now(UTC) + timedelta(minutes=5)
        results = [tasks.add.enqueue(1, 2), tasks.add.using(priority=5).enqueue(3, 4)]
        results.append(tasks.add.using(run_after=later).enqueue(5, 6))
        # Before: each was checked as a caller's retry key, and remembered for 24 h in the enqueued ids.
        assert not broker.client.exists(broker.keys.enqueued("default"))
        for result in results:
            assert tasks.add.get_result(result.id).id == result.id
        queued = [*broker.client.lrange(broker.keys.pending("default"), 0, -1)]
        queued += [
            member for member, _ in broker.client.zrange(broker.keys.prioritized("default"), 0, -1, withscores=True)
        ]
        assert {decode_task(raw).id for raw in queued} == {results[0].id, results[1].id}

    def test_rolled_back_transaction_enqueues_nothing(self, redis_tasks, broker, signals):
        with transaction.atomic():
            result = tasks.add.enqueue(1, 1)
            assert result.id
            transaction.set_rollback(True)

        assert redis_keys(broker) == []
        assert signals == []
        with pytest.raises(TaskResultDoesNotExist):
            tasks.add.get_result(result.id)

    def test_committed_transaction_enqueues_exactly_once(self, redis_tasks, broker, signals):
        with transaction.atomic():
            result = tasks.add.enqueue(1, 1)
            assert pending_count(broker) == 0 and result.enqueued_at is None
            with transaction.atomic():  # a savepoint's commit is not the commit
                tasks.add.enqueue(2, 2)
            assert pending_count(broker) == 0

        assert pending_count(broker) == 2
        assert result.enqueued_at is not None
        assert [name for name, *_ in signals] == ["enqueued", "enqueued"]
        assert tasks.add.get_result(result.id).args == [1, 1]

    def test_enqueue_on_commit_can_be_turned_off(self, settings, key_prefix, broker):
        settings.TASKS = {"default": {**REDIS_BACKEND, "OPTIONS": {"ENQUEUE_ON_COMMIT": False}}}
        with transaction.atomic():
            tasks.add.enqueue(1, 1)
            transaction.set_rollback(True)
        assert pending_count(broker) == 1

    def test_a_failed_push_after_commit_fails_that_task_loudly_and_later_hooks_still_run(
        self, redis_tasks, settings, signals, caplog
    ):
        redis_url = settings.REDIS_URL
        proxy = RedisProxy(get_broker().client.connection_pool.connection_kwargs["port"])
        settings.REDIS_URL = proxy.url
        hooks_run: list[str] = []
        try:
            with transaction.atomic():
                transaction.on_commit(proxy.cut)  # Redis goes away for the first task's push only
                lost = tasks.add.enqueue(1, 1)
                transaction.on_commit(proxy.restore)
                kept = tasks.add.enqueue(2, 2)
                transaction.on_commit(lambda: hooks_run.append("the user's hook"))
        finally:
            proxy.close()
            settings.REDIS_URL = redis_url

        assert hooks_run == ["the user's hook"]
        assert (lost.status, lost.enqueued_at, lost.is_finished) == (TaskResultStatus.FAILED, None, True)
        assert [error.exception_class_path for error in lost.errors] == ["tasks_app.producer.QueueUnavailable"]
        assert kept.status == TaskResultStatus.READY and kept.enqueued_at is not None
        assert tasks.add.get_result(kept.id).args == [2, 2]
        with pytest.raises(TaskResultDoesNotExist):
            tasks.add.get_result(lost.id)
        [logged] = [
            r for r in caplog.records if r.name == "tasks_app.django_tasks.backend" and lost.id in r.getMessage()
        ]
        assert logged.levelname == "ERROR"
        assert logged.exc_info is not None
        assert [(name, status) for name, _, _, status in signals] == [("finished", "FAILED"), ("enqueued", "READY")]

    def test_a_failed_push_outside_a_transaction_raises_to_the_caller(self, redis_tasks, settings, signals):
        settings.REDIS_URL = "redis://127.0.0.1:1/0"
        with pytest.raises(producer.QueueUnavailable):
            tasks.add.enqueue(1, 1)
        assert signals == []

    def test_run_after_stays_absolute_when_the_commit_comes_later(self, redis_tasks, broker):
        run_after = datetime.now(tz=UTC) + timedelta(minutes=5)
        with transaction.atomic():
            tasks.add.using(run_after=run_after).enqueue(1, 2)
            time.sleep(0.5)  # a transaction that takes a while to commit
        [(_, due_ms)] = broker.client.zrange(broker.keys.delayed("default"), 0, -1, withscores=True)
        assert abs(due_ms - run_after.timestamp() * 1000) < 200

    def test_priority_orders_work_and_queue_name_picks_the_queue(self, redis_tasks, broker):
        low = tasks.add.using(priority=-5).enqueue(0, 1)
        normal = tasks.add.enqueue(0, 2)
        high = tasks.add.using(priority=50).enqueue(0, 3)
        other = tasks.add.using(queue_name="other").enqueue(0, 4)

        assert broker.leases.heartbeat(["default"], "claimer", 5000, register_info={})
        claimed = broker.queue.claim("default", "claimer", 10) or []
        assert [decode_task(raw).id for raw in claimed] == [high.id, normal.id, low.id]
        assert pending_count(broker, "other") == 1
        assert tasks.add.get_result(high.id).task.priority == 50
        assert tasks.add.get_result(other.id).task.queue_name == "other"

    def test_a_whole_float_priority_is_taken_as_django_allows(self, redis_tasks, broker):
        result = tasks.add.using(priority=5.0).enqueue(1, 2)
        assert tasks.add.get_result(result.id).task.priority == 5
        with pytest.raises(InvalidTask, match="whole number"):
            tasks.add.using(priority=5.5)

    def test_run_after_goes_to_the_delayed_set(self, redis_tasks, broker):
        run_after = datetime.now(tz=UTC) + timedelta(minutes=5)
        result = tasks.add.using(run_after=run_after).enqueue(1, 2)

        stats = broker.inspect.queue_stats("default")
        assert (stats.pending, stats.delayed) == (0, 1)
        stored = tasks.add.get_result(result.id).task.run_after
        assert abs((stored - run_after).total_seconds()) < 0.01

    def test_get_result_of_unknown_or_foreign_ids_raises(self, redis_tasks, broker):
        with pytest.raises(TaskResultDoesNotExist):
            tasks.add.get_result(str(uuid.uuid4()))
        [plain] = producer.enqueue("demo.echo", [1])
        with pytest.raises(TaskResultDoesNotExist):
            task_backends["default"].get_result(plain.id)
        for hostile in ("\ud800", "a{b}", "\x00", "x" * 100_000):  # a lone surrogate cannot even be a key
            with pytest.raises(TaskResultDoesNotExist):
                task_backends["default"].get_result(hostile)

    def test_a_record_of_a_type_no_task_can_have_reads_as_none_without_a_query(self, redis_tasks, broker):
        # A NUL in a query is an error on PostgreSQL (its text holds none): before, get_result raised DataError there.
        broker.client.hset(broker.keys.result("t1"), mapping={"type": "shop.tasks.add\x00", "status": "READY"})
        with CaptureQueriesContext(connection) as queries, pytest.raises(TaskResultDoesNotExist):
            task_backends["default"].get_result("t1")
        assert queries.captured_queries == []

    def test_a_record_whose_status_is_none_we_write_reads_as_none(self, redis_tasks, broker):
        result = tasks.add.enqueue(1, 2)
        broker.client.hset(broker.keys.result(result.id), "status", "BOGUS")  # a foreign writer's
        with pytest.raises(TaskResultDoesNotExist):  # not a ValueError from TaskResultStatus
            task_backends["default"].get_result(result.id)

    def test_aenqueue_and_aget_result(self, redis_tasks, broker):
        result = async_to_sync(tasks.add.aenqueue)(4, 5)
        stored = async_to_sync(tasks.add.aget_result)(result.id)
        assert (stored.id, stored.status, stored.args) == (result.id, "READY", [4, 5])


# --- system checks -----------------------------------------------------------------------------
class TestCheck:
    def test_valid_configuration_passes(self, redis_tasks):
        assert task_backends["default"].check() == []

    def test_bad_queues_and_options_are_errors(self, settings, key_prefix):
        settings.TASKS = {
            "default": {**REDIS_BACKEND, "QUEUES": ["ok", "not ok"], "OPTIONS": {"ENQUEUE_ON_COMMIT": "yes", "TYPO": 1}}
        }
        ids = sorted(message.id for message in task_backends["default"].check())
        assert ids == ["tasks_app.E010", "tasks_app.E011", "tasks_app.E012"]

    def test_unreachable_redis_is_reported(self, settings):
        settings.TASKS = {"default": REDIS_BACKEND}
        settings.REDIS_URL = "redis://127.0.0.1:1/0"
        [message] = task_backends["default"].check()
        assert message.id == "tasks_app.W010"


# --- Django's behaviour contract: the same task, ImmediateBackend vs a real consumer --------------
CONTRACT_CASES = [
    (tasks.add, (2, 3), {}),
    (tasks.echo, ("a", 1), {"key": [1, 2]}),
    (tasks.fail, (), {"message": "boom"}),
    (tasks.not_json, (), {}),
    (tasks.attempt_and_workers, (), {}),
    (tasks.async_add, (1, 2), {}),
]


def outcome(result: Any) -> dict[str, Any]:
    """What Django's contract fixes about a finished result."""
    return {
        "status": result.status,
        "return_value": result.return_value if result.status == TaskResultStatus.SUCCESSFUL else None,
        "errors": [error.exception_class_path for error in result.errors],
        "attempts": result.attempts,
        "args": result.args,
        "kwargs": result.kwargs,
        "timestamps": all([result.enqueued_at, result.started_at, result.finished_at, result.last_attempted_at]),
    }


@pytest.mark.django_db(transaction=True)
def test_results_match_the_immediate_backend(redis_tasks, broker, consumer_in_thread, signals):
    for django_task, _, _ in CONTRACT_CASES:  # one attempt each, as ImmediateBackend makes
        TaskType.objects.create(name=django_task.module_path, handler=django_task.module_path, max_attempts=1)
    expected = []
    for django_task, args, kwargs in CONTRACT_CASES:
        expected.append(outcome(django_task.using(backend="immediate").enqueue(*args, **kwargs)))
    immediate_signals = [(name, path, status) for name, _, path, status in signals]
    signals.clear()

    enqueued = [django_task.enqueue(*args, **kwargs) for django_task, args, kwargs in CONTRACT_CASES]
    with consumer_in_thread(concurrency=1):
        wait_until(
            lambda: all(r.task.get_result(r.id).is_finished for r in enqueued), 20, message="every task to finish"
        )

    for (django_task, _, _), result, want in zip(CONTRACT_CASES, enqueued, expected, strict=True):
        assert outcome(django_task.get_result(result.id)) == want, django_task.module_path
    assert expected[3]["errors"] == ["builtins.TypeError"]  # a non-JSON return value fails the task
    assert expected[4]["return_value"] == {"attempt": 1, "workers": 1, "status": "RUNNING"}
    assert all(sender is RedisBackend for _, sender, _, _ in signals)
    assert by_task([(name, path, status) for name, _, path, status in signals]) == by_task(immediate_signals)


def by_task(sent: list[tuple[str, str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Signals grouped by task path, in the order each task's were sent."""
    grouped: dict[str, list[tuple[str, str]]] = {}
    for name, path, status in sent:
        grouped.setdefault(path, []).append((name, status))
    return grouped


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("redis_tasks")
@pytest.mark.parametrize("errors", ['[{"exception_class_path": "x.Error"}]', '[{"traceback": "t"}]', "[{}]"])
def test_a_producers_record_whose_error_misses_a_field_reads_with_that_field_empty(broker, errors):
    result = tasks.add.enqueue(1, 2)
    broker.client.hset(broker.keys.result(result.id), mapping={"status": "FAILED", "errors": errors})
    [error] = tasks.add.get_result(result.id).errors  # before: KeyError
    assert {error.exception_class_path, error.traceback} <= {"x.Error", "t", ""}
