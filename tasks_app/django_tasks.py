"""`django.tasks` on a consumer: run `@task` functions as ImmediateBackend does, read results back."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from traceback import format_exception
from typing import Any, Protocol

from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus
from django.tasks.base import TaskError
from django.tasks.exceptions import InvalidTask
from django.tasks.signals import task_finished, task_started
from django.utils.json import normalize_json

from .codec import Arguments
from .context import TaskContext as RunContext
from .models import TaskType
from .registry import Handler, Registry
from .results import RUNNING, ResultRecord


class ResultReader(Protocol):
    """Reads a result record's text fields (the broker)."""

    def get_result(self, task_id: str) -> dict[str, str] | None: ...


def find_handler(name: str, registry: Registry) -> Handler | None:
    """Return the handler of the `@task` function `name`, loading it only if a TaskType row names it."""
    handler = registry.get(name)
    if handler is not None:
        return handler if handler.django_task is not None else None
    # A type name read from Redis is imported only when the database vouches for it.
    if not TaskType.objects.filter(handler=name).exists():
        return None
    return registry.load_django_task(name)


def task_result_from_record(record: ResultRecord, task: Task, alias: str) -> TaskResult:
    """Build Django's TaskResult from a result record."""
    result: TaskResult = TaskResult(
        task=_as_enqueued(task, record),
        id=record.id,
        status=TaskResultStatus(record.status),
        enqueued_at=record.enqueued_at,
        started_at=record.started_at,
        finished_at=record.finished_at,
        last_attempted_at=record.last_attempted_at,
        args=record.args,
        kwargs=record.kwargs,
        backend=alias,
        errors=[
            TaskError(exception_class_path=error["exception_class_path"], traceback=error["traceback"])
            for error in record.errors
        ],
        worker_ids=list(record.worker_ids),
    )
    if record.has_return_value:
        object.__setattr__(result, "_return_value", record.return_value)
    return result


def _as_enqueued(task: Task, record: ResultRecord) -> Task:
    """The task with the priority, queue and run_after it was enqueued with."""
    try:
        return task.using(priority=record.priority, queue_name=record.queue or None, run_after=record.run_after)
    except InvalidTask:  # this process's backend would not accept it; the function is what matters
        return task


def run(
    task: Task,
    context: RunContext,
    arguments: Arguments,
    results: ResultReader,
    timed_out: Callable[[], BaseException | None] = lambda: None,
) -> Any:
    """Call a `@task` function as ImmediateBackend does; return its JSON-normalized value.

    `timed_out` says whether the consumer already failed this run for its timeout: then the
    late outcome of the function is not what happened, and task_finished reports the timeout.
    """
    from .backends import RedisBackend  # the signals' sender; imported here because it imports us

    fields = results.get_result(context.task_id) or {}
    record = ResultRecord.from_fields(
        {"id": context.task_id, "type": context.type, "queue": context.queue, **fields, "status": RUNNING}
    )
    task_result = task_result_from_record(record, task, task.backend)
    object.__setattr__(task_result, "args", arguments.args)
    object.__setattr__(task_result, "kwargs", arguments.kwargs)
    task_started.send(sender=RedisBackend, task_result=task_result)
    try:
        if task.takes_context:
            raw_return_value = task.call(TaskContext(task_result=task_result), *arguments.args, **arguments.kwargs)
        else:
            raw_return_value = task.call(*arguments.args, **arguments.kwargs)
        return_value = normalize_json(raw_return_value)
        # Stored as strict JSON: NaN and infinities fail here, not after task_finished.
        json.dumps(return_value, allow_nan=False)
        _raise_if_timed_out(timed_out)
    except KeyboardInterrupt:
        raise
    except BaseException as raised:
        exc = timed_out() or raised
        exception_type = type(exc)
        task_result.errors.append(
            TaskError(
                exception_class_path=f"{exception_type.__module__}.{exception_type.__qualname__}",
                traceback="".join(format_exception(exc)),
            )
        )
        # What get_result() shows after this run: READY again while attempts remain.
        if context.attempt < context.max_attempts:
            object.__setattr__(task_result, "status", TaskResultStatus.READY)
        else:
            object.__setattr__(task_result, "finished_at", _now())
            object.__setattr__(task_result, "status", TaskResultStatus.FAILED)
        task_finished.send(RedisBackend, task_result=task_result)
        raise
    object.__setattr__(task_result, "finished_at", _now())
    object.__setattr__(task_result, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(task_result, "_return_value", return_value)
    task_finished.send(RedisBackend, task_result=task_result)
    return return_value


def _raise_if_timed_out(timed_out: Callable[[], BaseException | None]) -> None:
    error = timed_out()
    if error is not None:
        raise error


def _now() -> datetime:
    return datetime.now(tz=UTC)
