"""What a latency probe task does when it starts: push (now - enqueued_at) in ms to Redis."""

from __future__ import annotations

import os
import threading
import time

LATENCY_KEY = "bench:latency"
_local = threading.local()


def record_start(enqueued_at: float) -> bool:
    """Record how long after `enqueued_at` (time.time() at enqueue) this task started."""
    started_ms = (time.time() - float(enqueued_at)) * 1000
    client = getattr(_local, "client", None)
    if client is None:
        import redis

        client = _local.client = redis.Redis.from_url(os.environ["BENCH_REDIS_URL"])
    client.rpush(LATENCY_KEY, f"{started_ms:.3f}")
    return True


def noop() -> bool:
    """Do nothing."""
    return True
