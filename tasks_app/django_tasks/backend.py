"""`tasks_app.backends.RedisBackend`: Django's tasks framework on this queue, its results read from result records."""

from __future__ import annotations

import functools
import logging
import uuid
import weakref
from contextlib import suppress
from traceback import format_exception
from typing import Any

from django.core.checks import CheckMessage, Error, Warning
from django.db import transaction
from django.tasks import Task, TaskResult, TaskResultStatus
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import TaskError
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued, task_finished
from django.utils import timezone

from tasks_app.models import TaskType
from tasks_app.producer import EnqueueError, PreparedBatch, QueueUnavailable, TaskRequest, prepare, push as push_batch
from tasks_app.protocol.broker import Broker, get_broker
from tasks_app.protocol.codec import MAX_JSON_DEPTH
from tasks_app.protocol.history import STATUSES
from tasks_app.protocol.keys import NAME_PATTERN, InvalidName, validate_name
from tasks_app.protocol.records import CANCELLED, ResultRecord, datetime_of_ms
from tasks_app.registry import Handler, Registry, registry

KNOWN_OPTIONS = {"ENQUEUE_ON_COMMIT"}
CANCELLED_ERROR_PATH = "tasks_app.exceptions.TaskCancelled"
NAME_HINT = "Use 1-100 characters from A-Z, a-z, 0-9 and _ . : -"

logger = logging.getLogger(__name__)


class RedisBackend(BaseTaskBackend):
    """Enqueue `@task` functions onto the Redis queue; `runconsumer` runs them."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.enqueue_on_commit = self.options.get("ENQUEUE_ON_COMMIT", True)

    def validate_task(self, task: Task) -> None:
        """Apply Django's rules, then ours (valid names); register the task as a handler."""
        super().validate_task(task)
        try:
            validate_name(task.queue_name, "queue")
            validate_name(task.module_path, "task name (module path)")
            # Registered so the producer accepts its type and creates its TaskType row.
            registry.add_django_task(task)
        except (InvalidName, ValueError) as exc:
            raise InvalidTask(str(exc)) from None

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        """Validate, then push the task now, or when the current transaction commits."""
        self.validate_task(task)
        result = self._ready_result(task, args, kwargs)
        # Everything is checked here, inside the caller's transaction; only the push waits. fresh_id: a new uuid4.
        request = task_request(task, result.args, result.kwargs, task_id=result.id, fresh_id=True)
        try:
            batch = prepare([request], registry=registry)
        except EnqueueError as exc:
            raise InvalidTask(str(exc)) from None
        broker = get_broker()
        if self.enqueue_on_commit and transaction.get_connection().in_atomic_block:
            push_later = functools.partial(self._push_after_commit, batch, broker, result)
            # Django drops the hook if the transaction rolls back: the send span then ends, having sent nothing.
            weakref.finalize(push_later, batch.sends.end, [])
            transaction.on_commit(push_later)
        else:
            self._push(batch, broker, result)  # a QueueUnavailable reaches the caller
        return result

    def _ready_result(self, task: Task, args: Any, kwargs: Any) -> TaskResult[Any, Any]:
        """The READY result of a new task; InvalidTask if its arguments nest too deeply for Django to normalise."""
        try:
            return TaskResult(
                task=task,
                id=str(uuid.uuid4()),
                status=TaskResultStatus.READY,
                enqueued_at=None,
                started_at=None,
                finished_at=None,
                last_attempted_at=None,
                args=args,
                kwargs=kwargs,
                backend=self.alias,
                errors=[],
                worker_ids=[],
            )
        except RecursionError:  # Django's normalize_json recurses once per level (or forever, on a cycle)
            raise InvalidTask(f"arguments may nest at most {MAX_JSON_DEPTH} levels") from None

    def _push(self, batch: PreparedBatch, broker: Broker, result: TaskResult[Any, Any]) -> None:
        [enqueued] = push_batch(batch, broker=broker)
        if enqueued.duplicate:  # a unique task's duplicate: the result is the first task's
            object.__setattr__(result, "id", enqueued.id)
        object.__setattr__(result, "enqueued_at", datetime_of_ms(enqueued.enqueued_at_ms))
        task_enqueued.send(type(self), task_result=result)

    def _push_after_commit(self, batch: PreparedBatch, broker: Broker, result: TaskResult[Any, Any]) -> None:
        """Push once the transaction committed; a failure fails this task only, loudly, and the later hooks run."""
        try:
            self._push(batch, broker, result)
        except QueueUnavailable as exc:
            message = "Task %s (%s) was not enqueued after its transaction committed: %s"
            logger.error(message, result.id, result.task.module_path, exc, exc_info=exc)
            result.errors.append(task_error(exc))
            object.__setattr__(result, "status", TaskResultStatus.FAILED)
            object.__setattr__(result, "finished_at", timezone.now())
            task_finished.send(type(self), task_result=result)

    def get_result(self, result_id: str) -> TaskResult:
        """Read a task's result record; raise TaskResultDoesNotExist if there is none."""
        fields = get_broker().records.get_result(str(result_id))
        if not fields:
            raise TaskResultDoesNotExist(result_id)
        record = ResultRecord.from_fields(fields)
        handler = find_handler(record.type, registry)
        # A plain handler's task is not a `@task` function's; a producer's status is no run's Django can read.
        if handler is None or record.status not in STATUSES:
            raise TaskResultDoesNotExist(result_id)
        return task_result_from_record(record, handler.django_task, self.alias)

    def check(self, **kwargs: Any) -> list[CheckMessage]:
        """Report invalid queues and options, and a Redis that does not answer."""
        where, known = f"TASKS[{self.alias!r}]", f"Known options: {', '.join(sorted(KNOWN_OPTIONS))}."
        messages: list[CheckMessage] = [
            *super().check(**kwargs),
            *(
                Error(f"{where} QUEUES has an invalid queue name {queue!r}", hint=NAME_HINT, id="tasks_app.E010")
                for queue in sorted(q for q in self.queues if not isinstance(q, str) or not NAME_PATTERN.fullmatch(q))
            ),
            *(
                Error(f"{where} OPTIONS has an unknown option {option!r}", hint=known, id="tasks_app.E011")
                for option in sorted(set(self.options) - KNOWN_OPTIONS)
            ),
        ]
        if not isinstance(self.enqueue_on_commit, bool):
            messages.append(Error(f"{where} OPTIONS['ENQUEUE_ON_COMMIT'] must be True or False", id="tasks_app.E012"))
        try:  # a warning, not an error: consumers start before Redis and reconnect with backoff
            get_broker().inspect.ping()
        except Exception as exc:  # any connection error means the same thing here
            hint = "Tasks cannot be enqueued until it does."
            messages.append(
                Warning(f"{where}: Redis at REDIS_URL does not answer: {exc}", hint=hint, id="tasks_app.W010")
            )
        return messages


def task_request(task: Task, args: Any, kwargs: Any, **fields: Any) -> TaskRequest:
    """The producer's request for a django.tasks task with its arguments (`fields`: the request's other fields)."""
    run_after = task.run_after
    if run_after is not None and timezone.is_naive(run_after):  # allowed only with USE_TZ = False
        run_after = timezone.make_aware(run_after)
    return TaskRequest(
        type=task.module_path,
        args=args,
        kwargs=kwargs,
        queue=task.queue_name,
        priority=int(task.priority),  # Django allows a whole float (5.0); validate_task checked it
        run_after=run_after,
        **fields,
    )


def find_handler(name: str, registry: Registry) -> Handler | None:
    """Return the handler of the `@task` function `name`, loading it only if a TaskType row names it."""
    handler = registry.get(name)
    if handler is not None:
        return handler if handler.django_task is not None else None
    # A type name read from Redis is imported only when the database vouches for it; one that breaks the
    # naming rule no row has (and a NUL in it PostgreSQL refuses in a query).
    if not NAME_PATTERN.fullmatch(name) or not TaskType.objects.filter(handler=name).exists():
        return None
    return registry.load_django_task(name)


def task_result_from_record(record: ResultRecord, task: Task, alias: str) -> TaskResult:
    """Build Django's TaskResult from a result record (CANCELLED reads as FAILED with a TaskCancelled error)."""
    errors = [  # a producer's entry may lack either field
        TaskError(exception_class_path=error.get("exception_class_path", ""), traceback=error.get("traceback", ""))
        for error in record.errors
    ]
    status = record.status
    if status == CANCELLED:  # django.tasks has no cancelled status
        status = TaskResultStatus.FAILED.value
        by = f" by {record.cancelled_by}" if record.cancelled_by else ""
        traceback = f"{CANCELLED_ERROR_PATH}: the task was cancelled{by}"
        errors.append(TaskError(exception_class_path=CANCELLED_ERROR_PATH, traceback=traceback))
    # The task as it was enqueued; this process's backend may refuse that: the function is what matters.
    with suppress(InvalidTask):
        task = task.using(priority=record.priority, queue_name=record.queue or None, run_after=record.run_after)
    result: TaskResult = TaskResult(
        task=task,
        id=record.id,
        status=TaskResultStatus(status),
        enqueued_at=record.enqueued_at,
        started_at=record.started_at,
        finished_at=record.finished_at,
        last_attempted_at=record.last_attempted_at,
        args=record.args,
        kwargs=record.kwargs,
        backend=alias,
        errors=errors,
        worker_ids=list(record.worker_ids),
    )
    if record.has_return_value:
        object.__setattr__(result, "_return_value", record.return_value)
    return result


def task_error(exc: BaseException) -> TaskError:
    """Django's record of an exception: its class path and its formatted traceback."""
    exception_type = type(exc)
    return TaskError(
        exception_class_path=f"{exception_type.__module__}.{exception_type.__qualname__}",
        traceback="".join(format_exception(exc)),
    )
