"""What a handler registered with ``takes_context=True`` receives first: the task and its run."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

# Longest progress message kept (characters); a longer one is cut.
MAX_PROGRESS_MESSAGE_CHARS = 1000


class RunControl:
    """The mutable side of a run, shared by its handler and its consumer: cancel flag and latest progress."""

    def __init__(self) -> None:
        # Plain flags (a bool's write is atomic; nobody waits on them): one is built per run.
        self.cancelled = False  # asked to stop (its consumer read a cancel request)
        self.forced = False  # cancelled by force (its consumer is stopping it)
        self._lock = threading.Lock()
        self._progress: dict[str, Any] | None = None  # set since the consumer last took it

    def cancel(self) -> None:
        self.cancelled = True

    def force(self) -> None:
        self.cancelled = self.forced = True

    def set_progress(self, progress: dict[str, Any]) -> None:
        """Keep the latest progress; the consumer writes it out, coalesced."""
        with self._lock:
            self._progress = progress

    def take_progress(self) -> dict[str, Any] | None:
        """Return the progress set since the last call (None if none was)."""
        with self._lock:
            progress, self._progress = self._progress, None
            return progress


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond every float: no JSON reader could take it as a number
        return False


def progress_value(current: float, total: float | None, message: str) -> dict[str, Any]:
    """Validate a handler's progress report and return its JSON form; ValueError/TypeError if invalid."""
    for name, value in (("current", current), ("total", total)):
        if value is None and name == "total":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value):
            raise TypeError(f"progress {name} must be a finite number, got {value!r}")
    if total is not None and total < 0:
        raise ValueError(f"progress total must not be negative, got {total!r}")
    if not isinstance(message, str):
        raise TypeError(f"progress message must be a string, got {type(message).__name__}")
    return {
        "current": current,
        "total": total,
        "message": message[:MAX_PROGRESS_MESSAGE_CHARS].encode("utf-8", "backslashreplace").decode("utf-8"),
        "updated_at": datetime.now(UTC).isoformat(),
    }


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
    control: RunControl = field(default_factory=RunControl, repr=False, compare=False)

    @property
    def cancelled(self) -> bool:
        """True once someone cancelled this task (within about a second); the handler may then raise TaskCancelled."""
        return self.control.cancelled

    def set_progress(self, current: float, total: float | None = None, message: str = "") -> None:
        """Report how far the run is; stored in the task's record as `progress`, at most a few writes a second."""
        self.control.set_progress(progress_value(current, total, message))


_current: ContextVar[TaskContext | None] = ContextVar("tasks_app_current_run", default=None)


def current() -> TaskContext:
    """The context of the run this code is part of (on its thread or in its coroutine); LookupError outside one."""
    context = _current.get()
    if context is None:
        raise LookupError("tasks_app.context.current() is only available while a consumer runs a task")
    return context


@contextlib.contextmanager
def running(context: TaskContext) -> Iterator[TaskContext]:
    """Make `context` what `current()` returns until the block ends (the consumer wraps each run in it)."""
    token = _current.set(context)
    try:
        yield context
    finally:
        # A run's coroutine dropped unfinished is closed wherever the collector finds it: in another
        # context, where there is nothing of its own to restore.
        with contextlib.suppress(ValueError):
            _current.reset(token)
