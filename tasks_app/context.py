"""What a handler registered with ``takes_context=True`` receives first: the task and its run."""

from dataclasses import dataclass


@dataclass(frozen=True)
class TaskContext:
    """What a handler registered with ``takes_context=True`` receives first."""

    task_id: str
    type: str
    queue: str
    attempt: int
    max_attempts: int
    headers: dict[str, str]
    consumer_id: str
