"""`django.tasks` on a consumer: run `@task` functions as ImmediateBackend does, read results back."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus
from django.tasks.signals import task_finished, task_started
from django.utils.json import normalize_json

from tasks_app.consumer.time_limits import call_unforked, exit_if_forked, within_timeout
from tasks_app.context import TaskContext as RunContext
from tasks_app.django_tasks.backend import RedisBackend, task_error, task_result_from_record
from tasks_app.protocol.codec import Arguments
from tasks_app.protocol.history import Records
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


def run(
    task: Task,
    context: RunContext,
    arguments: Arguments,
    results: Records,
    timed_out: Callable[[], BaseException | None] = lambda: None,
    begin: Callable[[], None] = lambda: None,
) -> Any:
    """Call a `@task` function as ImmediateBackend does; return its JSON-normalized value."""
    task_result = _started(task, context, arguments, results, begin)
    try:
        args = _args(task, task_result, context, arguments)
        # A child the function forked exits as it returns: task_finished is not its to send.
        return_value = _json_value(call_unforked(lambda: task.call(*args, **arguments.kwargs)))
        if (error := timed_out()) is not None:
            raise error
    except KeyboardInterrupt:
        raise
    except BaseException as raised:
        _finished(task_result, context, timed_out() or raised)
        raise
    return _finished(task_result, context, None, return_value)


def start_async(
    task: Task,
    context: RunContext,
    arguments: Arguments,
    results: Records,
    timeout_s: float | None,
    begin: Callable[[], None] = lambda: None,
) -> Callable[[], Coroutine[Any, Any, Any]]:
    """Send task_started for a run of an `async def` `@task` function; return what makes the coroutine that runs it."""
    task_result = _started(task, context, arguments, results)

    async def run_async() -> Any:
        begin()
        args = _args(task, task_result, context, arguments)
        pid = os.getpid()
        try:
            return_value = await within_timeout(task.func(*args, **arguments.kwargs), timeout_s)
            exit_if_forked(pid)  # a child the function forked: task_finished is not its to send
            return_value = _json_value(return_value)
        except KeyboardInterrupt:
            raise
        except BaseException as raised:
            exit_if_forked(pid)
            _finished(task_result, context, raised)
            raise
        return _finished(task_result, context, None, return_value)

    return run_async


def _started(
    task: Task, context: RunContext, arguments: Arguments, results: Records, begin: Callable[[], None] = lambda: None
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


def _args(task: Task, task_result: TaskResult, context: RunContext, arguments: Arguments) -> tuple[Any, ...]:
    if task.takes_context:
        return (RunTaskContext(task_result=task_result, run=context), *arguments.args)
    return tuple(arguments.args)


def _json_value(raw_return_value: Any) -> Any:
    """The return value as stored: JSON-normalized, strict (NaN and infinities fail here, not after task_finished)."""
    return_value = normalize_json(raw_return_value)
    json.dumps(return_value, allow_nan=False)
    return return_value


def _finished(task_result: TaskResult, context: RunContext, error: BaseException | None, value: Any = None) -> Any:
    """Send task_finished with the status get_result() shows next (READY while attempts remain); return `value`."""
    if error is None:
        status = TaskResultStatus.SUCCESSFUL
        object.__setattr__(task_result, "_return_value", value)
    else:
        task_result.errors.append(task_error(error))
        status = TaskResultStatus.READY if context.attempt < context.max_attempts else TaskResultStatus.FAILED
    if status != TaskResultStatus.READY:
        object.__setattr__(task_result, "finished_at", datetime.now(tz=UTC))
    object.__setattr__(task_result, "status", status)
    task_finished.send(RedisBackend, task_result=task_result)
    return value
