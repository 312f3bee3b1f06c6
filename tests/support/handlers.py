"""Handlers used by the tests; consumer subprocesses load them via TASK_HANDLER_MODULES."""

import asyncio
import json
import os
import signal
import threading
import time
from typing import Any

from tasks_app.protocol.broker import get_broker
from tasks_app.registry import handler

RUNS_KEY_SUFFIX = "test:runs"


def runs_key() -> str:
    """The Redis list where `test.record` appends one JSON line per run."""
    return f"{get_broker().keys.prefix}:{RUNS_KEY_SUFFIX}"


@handler("test.record", takes_context=True)
def record(context: Any, sleep_s: float = 0.0, fail_until_attempt: int = 0, hold_until: str = "", **extra: Any) -> int:
    """Record this run (task id, attempt, consumer, start time on the Redis clock), then work.

    With `hold_until` (a key of this test's prefix), the run goes on until the test creates that key (60 s at most).
    """
    broker = get_broker()
    seconds, micros = broker.client.time()
    broker.client.rpush(
        runs_key(),
        json.dumps(
            {
                "task_id": context.task_id,
                "attempt": context.attempt,
                "consumer": context.consumer_id,
                "type": context.type,
                "start_ms": seconds * 1000 + micros / 1000,
                "pid": os.getpid(),
                **extra,
            }
        ),
    )
    if sleep_s:
        time.sleep(float(sleep_s))
    held_until = time.monotonic() + 60
    while (
        hold_until and not broker.client.exists(f"{broker.keys.prefix}:{hold_until}") and time.monotonic() < held_until
    ):
        time.sleep(0.05)
    if context.attempt <= int(fail_until_attempt):
        raise RuntimeError(f"planned failure on attempt {context.attempt}")
    return context.attempt


# --- rate limits at the handler (tests/integration/test_rate_limits.py) ---
HANDLER_STARTS_KEY_SUFFIX = "test:handler_starts"


def note_handler_start(context: Any, started_s: float, extra: dict[str, Any]) -> None:
    """Append when (this machine's clock, in ms) a run's handler began, with its task id, type, consumer and `extra`."""
    broker = get_broker()
    entry = {
        "task_id": context.task_id,
        "type": context.type,
        "attempt": context.attempt,
        "consumer": context.consumer_id,
        "start_ms": started_s * 1000,
    }
    broker.client.rpush(f"{broker.keys.prefix}:{HANDLER_STARTS_KEY_SUFFIX}", json.dumps({**entry, **extra}))


@handler("test.handler_start", takes_context=True)
def handler_start(context: Any, sleep_s: float = 0.0, **extra: Any) -> None:
    """Note this run's start, read as the handler's first line; then work for `sleep_s`."""
    started_s = time.time()
    note_handler_start(context, started_s, extra)
    if sleep_s:
        time.sleep(float(sleep_s))


@handler("test.async_handler_start", takes_context=True)
async def async_handler_start(context: Any, **extra: Any) -> None:
    """Note this run's start, read as the coroutine's first line on the asyncio lane."""
    started_s = time.time()
    note_handler_start(context, started_s, extra)


@handler("test.block_loop")
async def block_loop(sleep_s: float) -> None:
    """Block the asyncio lane's loop for `sleep_s` (a sync call inside `async def`)."""
    time.sleep(float(sleep_s))


@handler("test.kill_self")
def kill_self() -> None:
    """Kill the consumer process running it: a poison pill."""
    os.kill(os.getpid(), signal.SIGKILL)


@handler("test.not_json")
def not_json() -> object:
    """Return something that is not JSON."""
    return object()


@handler("test.exit")
def exit_process() -> None:
    """Call sys.exit from a handler: must fail the task, not the worker."""
    raise SystemExit(3)


# --- hostile handlers: what real handlers do to a consumer (tests/chaos/test_hostile_input.py) ---
LONE_SURROGATE_TEXT = b"caf\xe9".decode("utf-8", "surrogateescape")  # what os.listdir gives for a Latin-1 name
HUGE_RETURN_BYTES = 2 * 1024 * 1024  # over the 1 MiB proto-max-bulk-len of the scenario's Redis


@handler("test.hostile_return")
def hostile_return(kind: str) -> str:
    """Return a lone-surrogate string ("surrogate") or a 2 MiB one ("huge")."""
    return LONE_SURROGATE_TEXT if kind == "surrogate" else "x" * HUGE_RETURN_BYTES


@handler("test.hostile_raise")
def hostile_raise() -> None:
    """Raise an exception whose message holds a lone surrogate."""
    raise RuntimeError(f"cannot open {LONE_SURROGATE_TEXT}")


@handler("test.hostile_sleep")
def hostile_sleep(sleep_s: float) -> None:
    """Sleep (past the type's timeout, in the hostile scenario)."""
    time.sleep(float(sleep_s))


# --- task control (tests/integration/test_task_control.py) ---
CANCEL_NOTICED_SUFFIX = "test:cancel_noticed"


def record_cancel_noticed() -> None:
    """Record when (on the Redis clock, in ms) the handler saw `context.cancelled`."""
    broker = get_broker()
    seconds, micros = broker.client.time()
    broker.client.set(f"{broker.keys.prefix}:{CANCEL_NOTICED_SUFFIX}", seconds * 1000 + micros // 1000)


@handler("test.cooperative", takes_context=True)
def cooperative(context: Any, max_s: float = 30.0) -> str:
    """Run until cancelled (then record when, on the Redis clock, and raise TaskCancelled) or `max_s` passed."""
    from tasks_app import TaskCancelled

    deadline = time.monotonic() + float(max_s)
    while time.monotonic() < deadline:
        if context.cancelled:
            record_cancel_noticed()
            raise TaskCancelled()
        time.sleep(0.02)
    return "not cancelled"


@handler("test.progress", takes_context=True)
def progress(context: Any, steps: int = 5, step_s: float = 0.5) -> int:
    """Report progress `steps` times, `step_s` apart."""
    for step in range(1, int(steps) + 1):
        time.sleep(float(step_s))
        context.set_progress(step, int(steps), f"step {step}")
    return int(steps)


# --- time limits and process mode (tests/integration/test_process_mode.py, test_async_lane.py) ---
MARKS_KEY_SUFFIX = "test:marks"


def mark(context: Any, what: str) -> None:
    """Append `what` this run reached (with its task id and process) to the marks list."""
    broker = get_broker()
    entry = {"task_id": context.task_id, "mark": what, "pid": os.getpid()}
    broker.client.rpush(f"{broker.keys.prefix}:{MARKS_KEY_SUFFIX}", json.dumps(entry))


@handler("test.hang", takes_context=True)
def hang(context: Any, sleep_s: float, step_s: float = 0.0) -> str:
    """Sleep (in one C call, or in steps of `step_s`), marking its start, its end and its `finally`."""
    mark(context, "start")
    try:
        if step_s:
            deadline = time.monotonic() + float(sleep_s)
            while time.monotonic() < deadline:
                time.sleep(float(step_s))
        else:
            time.sleep(float(sleep_s))
        mark(context, "end")
    finally:
        mark(context, "finally")
    return "woke up"


# --- the asyncio lane (tests/integration/test_async_lane.py) ---
_async_running = 0
_async_peak = 0


@handler("test.async_sleep")
async def async_sleep(sleep_s: float = 0.05) -> int:
    """Await `sleep_s`; return the most runs of this handler seen at once in this process."""
    global _async_running, _async_peak
    _async_running += 1
    _async_peak = max(_async_peak, _async_running)
    try:
        await asyncio.sleep(float(sleep_s))
    finally:
        _async_running -= 1
    return _async_peak


@handler("test.async_hang", takes_context=True)
async def async_hang(context: Any, sleep_s: float) -> str:
    """Await `sleep_s`, marking its start, its end and its `finally`."""
    mark(context, "start")
    try:
        await asyncio.sleep(float(sleep_s))
        mark(context, "end")
    finally:
        mark(context, "finally")
    return "woke up"


@handler("test.async_stops_loop")
async def async_stops_loop() -> str:
    """Stop the event loop it runs on (as a handler written for a loop of its own might), then go on."""
    asyncio.get_running_loop().stop()
    await asyncio.sleep(0.01)
    return "went on"


@handler("test.async_cooperative", takes_context=True)
async def async_cooperative(context: Any, step_s: float = 0.2, max_s: float = 30.0) -> str:
    """Report progress every `step_s` until cancelled (then record when, as test.cooperative does) or `max_s` passed."""
    from tasks_app import TaskCancelled

    deadline = time.monotonic() + float(max_s)
    step = 0
    while time.monotonic() < deadline:
        if context.cancelled:
            record_cancel_noticed()
            raise TaskCancelled()
        step += 1
        context.set_progress(step, None, f"step {step}")
        await asyncio.sleep(float(step_s))
    return "not cancelled"


@handler("test.leaves_thread")
def leaves_thread(sleep_s: float = 60.0) -> str:
    """Start a non-daemon thread that outlives the run (as a library's worker pool may), and return."""
    threading.Thread(target=time.sleep, args=(float(sleep_s),), name="left-running", daemon=False).start()
    return "left a thread"
