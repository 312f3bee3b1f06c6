"""Handlers of the throttle tests: runs that record their start and end on the Redis clock."""

import asyncio
import json
import os
import time
from typing import Any

from redis.exceptions import RedisError

from tasks_app.protocol.broker import get_broker
from tasks_app.registry import handler

SPANS_KEY_SUFFIX = "test:spans"
HOLD_KEY_SUFFIX = "test:hold"
MODULES = "tests.support.handlers,tests.support.throttle_handlers"


def _now_ms() -> float:
    seconds, micros = get_broker().client.time()
    return seconds * 1000 + micros / 1000


def _event(context: Any, event: str, **extra: Any) -> None:
    broker = get_broker()
    line = {"task_id": context.task_id, "event": event, "t_ms": _now_ms(), "pid": os.getpid(), **extra}
    broker.client.rpush(f"{broker.keys.prefix}:{SPANS_KEY_SUFFIX}", json.dumps(line))


@handler("test.span", takes_context=True)
def span(context: Any, sleep_s: float = 0.0, hold: bool = False, **extra: Any) -> None:
    """Record a start, work `sleep_s` (or, with `hold`, while the test's hold key exists), record an end."""
    _event(context, "start", **extra)
    if hold:
        hold_key = f"{get_broker().keys.prefix}:{HOLD_KEY_SUFFIX}"
        deadline = time.monotonic() + 60
        while _held(hold_key) and time.monotonic() < deadline:
            time.sleep(0.05)
    time.sleep(float(sleep_s))
    _event(context, "end", **extra)


@handler("test.async_span", takes_context=True)
async def async_span(context: Any, sleep_s: float = 0.0, **extra: Any) -> None:
    """`test.span` on the asyncio lane: record a start, await `sleep_s`, record an end."""
    _event(context, "start", **extra)
    await asyncio.sleep(float(sleep_s))
    _event(context, "end", **extra)


def _held(hold_key: str) -> bool:
    """Whether the test still holds runs; while Redis is away (a restart), yes."""
    try:
        return bool(get_broker().client.exists(hold_key))
    except RedisError:
        return True


def spans(broker: Any) -> list[dict[str, Any]]:
    """Every start and end event recorded so far, in order."""
    return [json.loads(item) for item in broker.client.lrange(f"{broker.keys.prefix}:{SPANS_KEY_SUFFIX}", 0, -1)]


def most_at_once(events: list[dict[str, Any]], open_until_ms: float = float("inf")) -> int:
    """The most runs in progress at one moment; a run with no end counts until `open_until_ms`."""
    starts = {e["task_id"] + str(e["pid"]): e["t_ms"] for e in events if e["event"] == "start"}
    ends = {e["task_id"] + str(e["pid"]): e["t_ms"] for e in events if e["event"] == "end"}
    # At equal times an end comes first: a slot freed and taken in the same millisecond is not an overlap.
    moments = [(t, 1) for t in starts.values()] + [(ends.get(run, open_until_ms), -1) for run in starts]
    running = most = 0
    for _, step in sorted(moments):
        running += step
        most = max(most, running)
    return most
