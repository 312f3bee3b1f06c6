"""What the producer's direct calls pay for: one enqueue's CPU with them and through redis-py's pool.

The two paths are interleaved round by round, so a busy machine slows both alike; the figure is
the producer's CPU per enqueue (process time), which the Redis server's own time does not enter.
"""

import statistics
import time

from ours import our_system
from peers.ours import Ours
from support import emit

ROUNDS = 5
PER_ROUND = 3000


def cpu_us_per_enqueue(system: Ours) -> float:
    """The producer's CPU per single enqueue, in µs."""
    started = time.process_time()
    for _ in range(PER_ROUND):
        system.enqueue_task()
    return (time.process_time() - started) / PER_ROUND * 1e6


if __name__ == "__main__":
    with our_system() as (system, client):
        calls = system.broker.enqueuer.redis
        direct = calls.direct
        cpu_us_per_enqueue(system)  # warm up connections, caches and scripts
        figures: dict[str, list[float]] = {"direct": [], "pool": []}
        for _ in range(ROUNDS):
            for path in figures:
                calls.direct = direct if path == "direct" else None
                figures[path].append(cpu_us_per_enqueue(system))
                client.flushall()
        calls.direct = direct
    direct_us, pool_us = (statistics.median(figures[path]) for path in ("direct", "pool"))
    emit(
        {
            "bench": "fast_paths",
            "enqueue_cpu_us_direct": round(direct_us, 1),
            "enqueue_cpu_us_pool": round(pool_us, 1),
            "direct_saves_pct": round(100 * (1 - direct_us / pool_us), 1),
        }
    )
