"""`django.tasks` on a consumer: run `@task` functions as ImmediateBackend does, read results back."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any, Protocol

from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus
from django.tasks.signals import task_finished, task_started
from django.utils.json import normalize_json

from tasks_app.consumer.time_limits import call_unforked, exit_if_forked, within_timeout
from tasks_app.context import TaskContext as RunContext
from tasks_app.django_tasks.backend import RedisBackend
from tasks_app.django_tasks.results import task_error, task_result_from_record
from tasks_app.protocol.codec import Arguments
from tasks_app.protocol.records import RUNNING, ResultRecord


# Frozen as Django's own TaskContext is (its stubs leave that out).
@dataclass(frozen=True, slots=True, kw_only=True)
class RunTaskContext(TaskContext):  # type: ignore[misc]
    """Django's TaskContext of a run on a consumer, with its cancel flag and progress reports."""

    run: RunContext

    @property
    def cancelled(self) -> bool:
        """True once someone cancelled this task (see tasks_app.context.TaskContext.cancelled)."""
        return self.run.cancelled

    def set_progress(self, current: float, total: float | None = None, message: str = "") -> None:
        """Report how far the run is, stored in the task's record (see tasks_app.context.TaskContext.set_progress)."""
        self.run.set_progress(current, total, message)


class ResultReader(Protocol):
    """Reads a result record's text fields (the broker's records)."""

    def get_result(self, task_id: str) -> dict[str, str] | None: ...


def run(
    task: Task,
    context: RunContext,
    arguments: Arguments,
    results: ResultReader,
    timed_out: Callable[[], BaseException | None] = lambda: None,
    begin: Callable[[], None] = lambda: None,
) -> Any:
    """Call a `@task` function as ImmediateBackend does; return its JSON-normalized value."""
    task_result = _started(task, context, arguments, results, begin)
    try:
        args = (
            (RunTaskContext(task_result=task_result, run=context), *arguments.args)
            if task.takes_context
            else arguments.args
        )
        # A child the function forked exits as it returns: task_finished is not its to send.
        raw_return_value = call_unforked(lambda: task.call(*args, **arguments.kwargs))
        return_value = _json_value(raw_return_value)
        _raise_if_timed_out(timed_out)
    except KeyboardInterrupt:
        raise
    except BaseException as raised:
        _record_failure(task_result, timed_out() or raised, context)
        raise
    return _record_success(task_result, return_value)


def start_async(
    task: Task,
    context: RunContext,
    arguments: Arguments,
    results: ResultReader,
    timeout_s: float | None,
    begin: Callable[[], None] = lambda: None,
) -> Callable[[], Coroutine[Any, Any, Any]]:
    """Send task_started for a run of an `async def` `@task` function; return what makes the coroutine that runs it."""
    task_result = _started(task, context, arguments, results)
    return partial(_run_async, task, task_result, context, arguments, timeout_s, begin)


async def _run_async(
    task: Task,
    task_result: TaskResult,
    context: RunContext,
    arguments: Arguments,
    timeout_s: float | None,
    begin: Callable[[], None],
) -> Any:
    begin()
    django_context = RunTaskContext(task_result=task_result, run=context)
    args = (django_context, *arguments.args) if task.takes_context else arguments.args
    pid = os.getpid()
    try:
        raw_return_value = await within_timeout(task.func(*args, **arguments.kwargs), timeout_s)
        exit_if_forked(pid)  # a child the function forked: task_finished is not its to send
        return_value = _json_value(raw_return_value)
    except KeyboardInterrupt:
        raise
    except BaseException as raised:
        exit_if_forked(pid)
        _record_failure(task_result, raised, context)
        raise
    return _record_success(task_result, return_value)


def _started(
    task: Task,
    context: RunContext,
    arguments: Arguments,
    results: ResultReader,
    begin: Callable[[], None] = lambda: None,
) -> TaskResult:
    """The run's TaskResult, read from its RUNNING record; task_started is sent once `begin()` returned."""
    fields = results.get_result(context.task_id) or {}
    record = ResultRecord.from_fields(
        {"id": context.task_id, "type": context.type, "queue": context.queue, **fields, "status": RUNNING}
    )
    task_result = task_result_from_record(record, task, task.backend)
    object.__setattr__(task_result, "args", arguments.args)
    object.__setattr__(task_result, "kwargs", arguments.kwargs)
    begin()
    task_started.send(sender=RedisBackend, task_result=task_result)
    return task_result


def _json_value(raw_return_value: Any) -> Any:
    """The return value as stored: JSON-normalized, strict (NaN and infinities fail here, not after task_finished)."""
    return_value = normalize_json(raw_return_value)
    json.dumps(return_value, allow_nan=False)
    return return_value


def _record_success(task_result: TaskResult, return_value: Any) -> Any:
    object.__setattr__(task_result, "finished_at", _now())
    object.__setattr__(task_result, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(task_result, "_return_value", return_value)
    task_finished.send(RedisBackend, task_result=task_result)
    return return_value


def _record_failure(task_result: TaskResult, exc: BaseException, context: RunContext) -> None:
    """Add the run's error to `task_result` and send task_finished with the status get_result() shows next."""
    task_result.errors.append(task_error(exc))
    # What get_result() shows after this run: READY again while attempts remain.
    if context.attempt < context.max_attempts:
        object.__setattr__(task_result, "status", TaskResultStatus.READY)
    else:
        object.__setattr__(task_result, "finished_at", _now())
        object.__setattr__(task_result, "status", TaskResultStatus.FAILED)
    task_finished.send(RedisBackend, task_result=task_result)


def _raise_if_timed_out(timed_out: Callable[[], BaseException | None]) -> None:
    error = timed_out()
    if error is not None:
        raise error


def _now() -> datetime:
    return datetime.now(tz=UTC)
