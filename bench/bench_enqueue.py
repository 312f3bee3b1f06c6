"""Enqueue throughput: one `producer.enqueue` call per task, and `enqueue_many` batches.

The shared workload's bulk batches repeat one request object, which the producer validates and
encodes once per batch; `enqueue_bulk_distinct_per_s` is the bulk rate when every request differs
(its own argument), so each is validated and encoded on its own.
"""

import time
from typing import Any

from ours import our_system
from peers.ours import QUEUE, Ours
from support import emit
from workloads import Sizes, run_enqueue


def distinct_bulk_per_s(system: Ours, sizes: Sizes) -> int:
    """Tasks/s for `enqueue_many` batches of requests that all differ."""
    request = system.producer.TaskRequest
    batches = [
        [request("bench.noop", [start + i], queue=QUEUE) for i in range(sizes.batch)]
        for start in range(0, sizes.bulk, sizes.batch)
    ]
    system.producer.enqueue_many(batches[0], broker=system.broker)  # warm up
    started = time.perf_counter()
    for batch in batches:
        system.producer.enqueue_many(batch, broker=system.broker)
    return round(len(batches) * sizes.batch / (time.perf_counter() - started))


if __name__ == "__main__":
    sizes = Sizes(single=5000, bulk=100000, batch=1000)
    with our_system() as (system, client):
        figures: dict[str, Any] = run_enqueue(system, client, sizes)
        figures["enqueue_bulk_distinct_per_s"] = distinct_bulk_per_s(system, sizes)
        client.flushall()
    emit({"bench": "enqueue", "batch": sizes.batch, **figures})
