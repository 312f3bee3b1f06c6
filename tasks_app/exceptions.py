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
