"""Handlers whose outcomes are hard to store or to stop; consumer subprocesses load them too."""

import json
import time
from typing import Any

from tasks_app import PermanentError, Retry
from tasks_app.protocol.broker import get_broker
from tasks_app.registry import handler

SPANS_KEY_SUFFIX = "test:spans"


def spans_key() -> str:
    """The Redis list where `settle.timed` and `settle.busy` append what each run did, and when."""
    return f"{get_broker().keys.prefix}:{SPANS_KEY_SUFFIX}"


def _redis_now_s() -> float:
    seconds, micros = get_broker().client.time()
    return seconds + micros / 1e6


def _note(context: Any, event: str) -> None:
    get_broker().client.rpush(
        spans_key(),
        json.dumps({"task_id": context.task_id, "attempt": context.attempt, "event": event, "at_s": _redis_now_s()}),
    )


@handler("settle.latin1_name")
def latin1_name() -> str:
    """Return what os.listdir gives for a Latin-1 file name: text with a lone surrogate."""
    return b"caf\xe9".decode("utf-8", "surrogateescape")


@handler("settle.big")
def big(size: int) -> str:
    """Return a string of `size` characters."""
    return "x" * int(size)


@handler("settle.raise_latin1")
def raise_latin1() -> None:
    """Raise an exception whose message holds a lone surrogate."""
    raise RuntimeError("cannot open " + b"caf\xe9".decode("utf-8", "surrogateescape"))


@handler("settle.timed", takes_context=True)
def timed(context: Any, sleep_s: float) -> float:
    """Note the start and the end of this run (Redis clock) around a sleep."""
    _note(context, "start")
    try:
        time.sleep(float(sleep_s))
    finally:
        _note(context, "end")
    return float(sleep_s)


@handler("settle.busy", takes_context=True)
def busy(context: Any, run_s: float) -> int:
    """Spin in pure Python for `run_s`; its `finally` notes when it ran."""
    _note(context, "start")
    spins = 0
    try:
        deadline = time.monotonic() + float(run_s)
        # Not `while time.monotonic() < deadline`: CPython 3.13.0 skips the `finally` of an
        # exception raised from another thread at the back edge of such a loop (README: timeouts).
        while True:
            if time.monotonic() >= deadline:
                break
            spins += 1
    finally:
        _note(context, "finally")
    return spins


@handler("settle.asks_retry", takes_context=True)
def asks_retry(context: Any, in_s: float, until_attempt: int) -> int:
    """Note this run, then ask to run again in `in_s` until attempt `until_attempt`, which returns its attempt."""
    _note(context, "start")
    if context.attempt < int(until_attempt):
        raise Retry(f"not yet on attempt {context.attempt}", in_s=float(in_s))
    return int(context.attempt)


@handler("settle.async_asks_retry", takes_context=True)
async def async_asks_retry(context: Any, in_s: float, until_attempt: int) -> int:
    """`settle.asks_retry` on the asyncio lane."""
    return asks_retry(context, in_s, until_attempt)


@handler("settle.permanent", takes_context=True)
def permanent(context: Any) -> None:
    """Note this run and fail for good."""
    _note(context, "start")
    raise PermanentError("the account is closed")
