"""What the benchmark's tasks do, for every system: a no-op, a latency probe, one Redis round trip, a chord's callback.

Standard library only at import time: redis-py (in every venv) is imported when a task first runs.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

LATENCY_KEY = "bench:latency"
OPS_KEY = "bench:ops"
CHORD_KEY = "bench:chord"
_local = threading.local()
_async_clients: dict[int, Any] = {}


def _thread_client() -> Any:
    """This thread's redis-py client to the benchmark's Redis, made on first use."""
    client = getattr(_local, "client", None)
    if client is None:
        import redis

        client = _local.client = redis.Redis.from_url(os.environ["BENCH_REDIS_URL"])
    return client


def record_start(enqueued_at: float) -> bool:
    """Record how long after `enqueued_at` (time.time() at enqueue) this task started."""
    started_ms = (time.time() - float(enqueued_at)) * 1000
    _thread_client().rpush(LATENCY_KEY, f"{started_ms:.3f}")
    return True


def noop() -> bool:
    """Do nothing."""
    return True


def chord_done(results: list[Any]) -> bool:
    """A chord's callback: record how many member results it got."""
    _thread_client().set(CHORD_KEY, len(results))
    return True


def redis_op() -> bool:
    """One Redis round trip (INCR) on this thread's connection: what most real handlers add."""
    _thread_client().incr(OPS_KEY)
    return True


async def async_redis_op() -> bool:
    """The same round trip from an `async def` task, on the running loop's redis.asyncio client."""
    loop_id = id(asyncio.get_running_loop())
    client = _async_clients.get(loop_id)
    if client is None:
        import redis.asyncio

        client = _async_clients[loop_id] = redis.asyncio.Redis.from_url(
            os.environ["BENCH_REDIS_URL"], max_connections=200
        )
    await client.incr(OPS_KEY)
    return True
