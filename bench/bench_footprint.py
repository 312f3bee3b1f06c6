"""Footprint: Redis bytes per queued task (INFO delta and MEMORY USAGE), its history index's share, consumer RSS."""

import time

from ours import our_system
from peers.ours import QUEUE
from support import emit
from workloads import Sizes, enqueue_backlog, run_footprint

IDLE_SETTLE_S = 2.0

if __name__ == "__main__":
    sizes = Sizes(footprint=50000)
    with our_system() as (system, client):
        figures = run_footprint(system, client, sizes)
        # One READY result record, as the producer writes it beside every task.
        system.enqueue_task()
        result_key = next(iter(client.scan_iter(system.broker.keys.result("*"))))
        result_record_bytes = int(client.memory_usage(result_key, samples=0))
        client.flushall()
        from tasks_app.protocol.history import index_keys  # importable once Ours() has set the project up

        # The history index (behind the task browser) alone: MEMORY USAGE of its keys, all of them sampled.
        enqueue_backlog(system, sizes.footprint, sizes.batch)
        index_bytes = sum(
            int(client.memory_usage(key, samples=0) or 0) for key in index_keys(system.broker.keys, QUEUE)
        )
        client.flushall()
        worker = system.start_worker()
        try:
            time.sleep(IDLE_SETTLE_S)
            worker.check_alive()
            idle_rss = worker.rss_bytes()
        finally:
            worker.stop()
    emit(
        {
            "bench": "footprint",
            "tasks": sizes.footprint,
            **figures,
            "result_record_bytes": result_record_bytes,
            "history_index_bytes_per_task": round(index_bytes / sizes.footprint, 1),
            "consumer_idle_rss_mb": round(idle_rss / 2**20, 1),
        }
    )
