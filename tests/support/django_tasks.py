"""`@task` functions for the django.tasks tests; consumer subprocesses load them via TASK_HANDLER_MODULES."""

import time
from typing import Any

from django.tasks import TaskContext, task


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
