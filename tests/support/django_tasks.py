"""`@task` functions for the django.tasks tests; consumer subprocesses load them via TASK_HANDLER_MODULES."""

import time
from typing import Any

from django.tasks import TaskContext, task

from tasks_app.django_tasks.runner import RunTaskContext


@task
def add(a: int, b: int) -> int:
    """Return the sum."""
    return a + b


@task
def echo(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """Return the arguments, as tuples and all: the return value is JSON-normalized."""
    return {"args": args, "kwargs": kwargs, "bytes": b"ok", "tuple": (1, 2)}


@task
def fail(message: str = "planned failure") -> None:
    """Raise every time."""
    raise ValueError(message)


@task
def not_json() -> object:
    """Return something JSON cannot hold."""
    return {"when": object()}


@task(takes_context=True)
def flaky(context: TaskContext, failures: int = 2) -> int:
    """Fail on the first `failures` attempts (naming the attempt), then return the attempt number."""
    if context.attempt <= failures:
        raise RuntimeError(f"planned failure on attempt {context.attempt}")
    return context.attempt


@task(takes_context=True)
def attempt_and_workers(context: TaskContext) -> dict[str, Any]:
    """Return what the context says about this run."""
    return {
        "attempt": context.attempt,
        "workers": len(context.task_result.worker_ids),
        "status": context.task_result.status,
    }


@task
async def async_add(a: int, b: int) -> int:
    """A coroutine task: the sum."""
    return a + b


@task
def nap(seconds: float) -> float:
    """Sleep, then return how long: outlives a short timeout."""
    time.sleep(seconds)
    return seconds


@task(takes_context=True)
def cooperative(context: RunTaskContext, step_s: float = 0.1, max_s: float = 30.0) -> str:
    """Report progress on Django's context until cancelled (then raise TaskCancelled), as a handler would."""
    from tasks_app import TaskCancelled
    from tasks_app.context import current

    assert current() is context.run, "current() is the run behind Django's context"
    deadline = time.monotonic() + max_s
    step = 0
    while time.monotonic() < deadline:
        if context.cancelled:
            raise TaskCancelled()
        step += 1
        context.set_progress(step, message=f"step {step}")
        time.sleep(step_s)
    return "not cancelled"
