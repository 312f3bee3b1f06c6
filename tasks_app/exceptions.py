"""Public exceptions of the task queue: what a handler may catch and what a result record names."""

from __future__ import annotations


class TaskTimeout(Exception):
    """The handler ran longer than its task type's timeout (raised inside it: a soft limit)."""

    def __init__(self, message: str = "the task exceeded its timeout") -> None:
        super().__init__(message)


class ResultNotJson(TypeError):
    """The handler returned a value that cannot be stored as UTF-8 JSON."""


class ResultTooLarge(ValueError):
    """The handler returned a value whose JSON is over TASKS_MAX_RESULT_BYTES."""


class TaskCancelled(Exception):
    """Raised by a handler that stops because its task was cancelled (see TaskContext.cancelled).

    The run then ends CANCELLED, without a retry. django.tasks reports a cancelled task as
    FAILED with one error whose exception_class_path is tasks_app.exceptions.TaskCancelled.
    """

    def __init__(self, message: str = "the task was cancelled") -> None:
        super().__init__(message)


class CancelError(Exception):
    """A cancel that did nothing: the task is unknown or already finished."""


class TaskNotFound(CancelError, LookupError):
    """No task has this id (or its record has expired)."""


class TaskAlreadyFinished(CancelError):
    """The task had already finished (succeeded, failed or was cancelled): nothing to cancel."""
