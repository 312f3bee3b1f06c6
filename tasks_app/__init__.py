"""A reliable, rate-limited task queue for Django on Redis."""

from tasks_app.control import cancel, cancel_many
from tasks_app.exceptions import PermanentError, Retry, TaskAlreadyFinished, TaskCancelled, TaskNotFound, TaskTimeout
from tasks_app.registry import handler
from tasks_app.workflows import cancel_workflow, chain, chord, get_workflow, group, step

__all__ = [
    "PermanentError",
    "Retry",
    "TaskAlreadyFinished",
    "TaskCancelled",
    "TaskNotFound",
    "TaskTimeout",
    "cancel",
    "cancel_many",
    "cancel_workflow",
    "chain",
    "chord",
    "get_workflow",
    "group",
    "handler",
    "step",
]
