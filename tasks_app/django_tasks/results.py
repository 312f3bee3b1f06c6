"""Django's TaskResult read from this queue's result records, and the `@task` function a type names."""

from __future__ import annotations

from traceback import format_exception

from django.tasks import Task, TaskResult, TaskResultStatus
from django.tasks.base import TaskError
from django.tasks.exceptions import InvalidTask

from tasks_app.models import TaskType
from tasks_app.protocol.keys import NAME_PATTERN
from tasks_app.protocol.records import CANCELLED, ResultRecord
from tasks_app.registry import Handler, Registry


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
        errors.append(TaskError(exception_class_path=CANCELLED_ERROR_PATH, traceback=_cancelled_text(record)))
    result: TaskResult = TaskResult(
        task=_as_enqueued(task, record),
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


CANCELLED_ERROR_PATH = "tasks_app.exceptions.TaskCancelled"


def task_error(exc: BaseException) -> TaskError:
    """Django's record of an exception: its class path and its formatted traceback."""
    exception_type = type(exc)
    return TaskError(
        exception_class_path=f"{exception_type.__module__}.{exception_type.__qualname__}",
        traceback="".join(format_exception(exc)),
    )


def _cancelled_text(record: ResultRecord) -> str:
    by = f" by {record.cancelled_by}" if record.cancelled_by else ""
    return f"tasks_app.exceptions.TaskCancelled: the task was cancelled{by}"


def _as_enqueued(task: Task, record: ResultRecord) -> Task:
    """The task with the priority, queue and run_after it was enqueued with."""
    try:
        return task.using(priority=record.priority, queue_name=record.queue or None, run_after=record.run_after)
    except InvalidTask:  # this process's backend would not accept it; the function is what matters
        return task
