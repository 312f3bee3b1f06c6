"""Handlers the benchmarks enqueue: a no-op, a latency probe, a Redis round trip (sync, async), a chord's callback."""

import asyncio

from bench.probe import async_redis_op, chord_done, noop, record_start, redis_op
from tasks_app import handler

handler("bench.noop")(noop)
handler("bench.probe")(record_start)
handler("bench.redis_op")(redis_op)
handler("bench.async_redis_op")(async_redis_op)
handler("bench.chord_done")(chord_done)


@handler("bench.async_sleep")
async def async_sleep(sleep_s: float = 0.05) -> bool:
    """Await `sleep_s`: an I/O wait with nothing to compute."""
    await asyncio.sleep(float(sleep_s))
    return True
