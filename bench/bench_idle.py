"""Idle cost: 1, 10 and 100 idle consumers; Redis commands/s and CPU, in all and per consumer."""

import os
import time

from ours import our_system
from peers.ours import QUEUE
from support import emit, wait_for
from workloads import IDLE_COST_WINDOW_S, IDLE_SETTLE_S, idle_cost

COUNTS = tuple(int(n) for n in os.environ.get("BENCH_IDLE_COUNTS", "1,10,100").split(","))

if __name__ == "__main__":
    figures: dict[str, dict[str, float]] = {}
    with our_system() as (system, client):
        for count in COUNTS:
            workers = [system.start_worker() for _ in range(count)]
            try:
                wait_for(
                    lambda: len(system.broker.inspect.queue_stats(QUEUE).consumers) >= len(system.consumer_ids),
                    300,
                    f"{count} consumers did not all register",
                    interval_s=0.2,
                )
                time.sleep(IDLE_SETTLE_S)
                cost = idle_cost(client, workers, window_s=IDLE_COST_WINDOW_S)
            finally:
                for worker in workers:
                    worker.stop()
            system.consumer_ids.clear()
            client.flushall()
            figures[str(count)] = {
                "commands_per_s": round(cost["commands_per_s"], 1),
                "commands_per_s_per_consumer": round(cost["commands_per_s"] / count, 2),
                "redis_cpu_ms_per_s_per_consumer": round(cost["redis_cpu_ms_per_s"] / count, 3),
                "consumer_cpu_ms_per_s_per_consumer": round(cost["worker_cpu_ms_per_s"] / count, 2),
            }
    emit({"bench": "idle", "consumers": figures})
