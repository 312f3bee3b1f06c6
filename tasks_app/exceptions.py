"""Public exceptions of the task queue: what a handler may catch and what a result record names."""

from __future__ import annotations

import math


class TaskTimeout(Exception):
    """The handler ran longer than its task type's timeout (raised inside it: a soft limit)."""

    def __init__(self, message: str = "the task exceeded its timeout") -> None:
        super().__init__(message)


class Retry(Exception):
    """Raised by a handler to run its task again `in_s` seconds from now instead of after its backoff."""

    def __init__(self, reason: str = "the handler asked to be retried", in_s: float | None = None) -> None:
        try:
            valid = in_s is None or (
                isinstance(in_s, int | float) and not isinstance(in_s, bool) and math.isfinite(in_s) and in_s >= 0
            )
        except OverflowError:  # an int past a float's range (10**400)
            valid = False
        if not valid:
            raise ValueError(f"Retry(in_s=...) takes a finite number of seconds >= 0 or None, got {in_s!r}")
        super().__init__(reason)
        self.in_s = in_s


class TaskInterrupted(Exception):
    """The consumer stopped while the task ran, and its run was still going when the grace period ended."""


class PermanentError(Exception):
    """Raised by a handler whose task can never succeed: dead-lettered at once, its other attempts unused."""


class ResultNotJson(TypeError):
    """The handler returned a value that cannot be stored as UTF-8 JSON."""


class ResultTooLarge(ValueError):
    """The handler returned a value whose JSON is over TASKS_MAX_RESULT_BYTES."""


class TaskCancelled(Exception):
    """Raised by a handler that stops because its task was cancelled (see TaskContext.cancelled)."""

    def __init__(self, message: str = "the task was cancelled") -> None:
        super().__init__(message)


class CancelError(Exception):
    """A cancel that did nothing: the task is unknown or already finished."""


class TaskNotFound(CancelError, LookupError):
    """No task has this id (or its record has expired)."""


class TaskAlreadyFinished(CancelError):
    """The task had already finished (succeeded, failed or was cancelled): nothing to cancel."""
