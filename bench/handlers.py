"""Handlers the benchmarks enqueue: a no-op, a latency probe, one Redis round trip, sync and async."""

import asyncio
import os
import threading
from typing import Any

import redis
import redis.asyncio

from bench.probe import noop, record_start
from tasks_app import handler

handler("bench.noop")(noop)
handler("bench.probe")(record_start)

OPS_KEY = "bench:ops"
_local = threading.local()
_async_clients: dict[int, Any] = {}


@handler("bench.redis_op")
def redis_op() -> bool:
    """One Redis round trip (INCR) on this thread's connection: what most real handlers add."""
    client = getattr(_local, "client", None)
    if client is None:
        client = _local.client = redis.Redis.from_url(os.environ["BENCH_REDIS_URL"])
    client.incr(OPS_KEY)
    return True


@handler("bench.async_redis_op")
async def async_redis_op() -> bool:
    """The same round trip from an `async def` handler, on the loop's redis.asyncio client."""
    loop_id = id(asyncio.get_running_loop())
    client = _async_clients.get(loop_id)
    if client is None:
        client = _async_clients[loop_id] = redis.asyncio.Redis.from_url(
            os.environ["BENCH_REDIS_URL"], max_connections=200
        )
    await client.incr(OPS_KEY)
    return True


@handler("bench.async_sleep")
async def async_sleep(sleep_s: float = 0.05) -> bool:
    """Await `sleep_s`: an I/O wait with nothing to compute."""
    await asyncio.sleep(float(sleep_s))
    return True
