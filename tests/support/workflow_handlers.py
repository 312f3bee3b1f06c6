"""Handlers of the workflow tests, and a point a test can kill a consumer at; consumer subprocesses load them too.

Loaded in a consumer, this module wraps `tasks_app.workflows.task_ended`: when the test names a task
path in `<prefix>:test:kill_before_end` (or `kill_after_end`), the consumer settling that task kills
itself with SIGKILL before recording its end (or after recording it and pushing what it started,
before its ack).
"""

import json
import os
import signal
import time
from typing import Any

from tasks_app import PermanentError, workflows
from tasks_app.protocol.broker import get_broker
from tasks_app.registry import handler

RUNS_SUFFIX = "test:wf_runs"


def runs_key() -> str:
    """The Redis list where each run of these handlers appends a JSON line: its task id, type and arguments."""
    return f"{get_broker().keys.prefix}:{RUNS_SUFFIX}"


def kill_key(when: str) -> str:
    return f"{get_broker().keys.prefix}:test:kill_{when}_end"


def _note(context: Any, *args: Any) -> None:
    line = {"task_id": context.task_id, "type": context.type, "args": list(args), "pid": os.getpid()}
    get_broker().client.rpush(runs_key(), json.dumps(line))


@handler("wf.value", takes_context=True)
def value(context: Any, *args: Any, sleep_s: float = 0.0) -> Any:
    """Return the last argument (a chain step's own, after the input it got), after `sleep_s`."""
    _note(context, *args)
    time.sleep(float(sleep_s))
    return args[-1]


@handler("wf.async_value", takes_context=True)
async def async_value(context: Any, *args: Any) -> Any:
    """`wf.value` on the asyncio lane."""
    _note(context, *args)
    return args[-1]


@handler("wf.add", takes_context=True)
def add(context: Any, total: int, n: int) -> int:
    """Add `n` to what the step before returned."""
    _note(context, total, n)
    return total + n


@handler("wf.collect", takes_context=True)
def collect(context: Any, results: list[Any], *args: Any) -> int:
    """A chord's callback: note the results it got; return how many."""
    _note(context, results, *args)
    return len(results)


@handler("wf.fails_until_fixed", takes_context=True)
def fails_until_fixed(context: Any, *args: Any) -> Any:
    """Fail for good until the test sets `<prefix>:test:fixed`; then return the last argument."""
    _note(context, *args)
    broker = get_broker()
    if not broker.client.exists(f"{broker.keys.prefix}:test:fixed"):
        raise PermanentError("not fixed yet")
    return args[-1]


@handler("wf.hold", takes_context=True)
def hold(context: Any, *args: Any) -> Any:
    """Wait (up to 60 s) until the test sets `<prefix>:test:release`; return the last argument."""
    _note(context, *args)
    broker = get_broker()
    for _ in range(1200):
        if broker.client.exists(f"{broker.keys.prefix}:test:release"):
            break
        signal.sigtimedwait([], 0.05)
    return args[-1]


_task_ended = workflows.task_ended


def _killable_task_ended(broker: Any, headers: Any, *args: Any, **kwargs: Any) -> None:
    path = headers.get(workflows.WORKFLOW_PATH_HEADER, "")
    client = broker.client
    if client.get(kill_key("before")) == path.encode() and client.delete(kill_key("before")):
        os.kill(os.getpid(), signal.SIGKILL)
    _task_ended(broker, headers, *args, **kwargs)
    if client.get(kill_key("after")) == path.encode() and client.delete(kill_key("after")):
        os.kill(os.getpid(), signal.SIGKILL)


workflows.task_ended = _killable_task_ended
