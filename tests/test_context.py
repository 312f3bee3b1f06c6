"""A run's context: what `current()` returns inside it, and nothing left behind however the run ends."""

import contextvars
from collections.abc import Generator

import pytest

from tasks_app.consumer.executor import as_current
from tasks_app.context import TaskContext, current, running


def _context(task_id: str = "t1") -> TaskContext:
    return TaskContext(task_id, "demo.echo", "default", 1, 3, {}, "c1")


def test_current_is_the_runs_context_inside_it_only():
    with running(_context()) as context:
        assert current() is context
    with pytest.raises(LookupError):
        current()


def test_a_coroutine_run_closed_from_another_context_ends_quietly():
    # A run's coroutine dropped unfinished (its event loop closed, the process leaving) is closed
    # wherever the collector finds it: its context's reset must not raise there.
    class Pending:
        def __await__(self) -> Generator[None]:
            yield  # suspended here, as a run waiting on I/O

    coroutine = as_current(_context(), Pending)
    contextvars.copy_context().run(coroutine.send, None)
    coroutine.close()  # in this context, not the one it ran in: nothing raised
    with pytest.raises(LookupError):
        current()
