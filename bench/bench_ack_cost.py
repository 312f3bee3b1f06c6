"""Ack cost: time of one ack (with its result write) while 10, 1,000 or 100,000 tasks are in flight
on other consumers; it must not grow with them (it is O(this consumer's in-flight)).

Each level has its own queue, all filled at once, and acks alternate between the levels, so
every level sees the same Redis (same key count, same memory) and the same machine noise.
"""

import time

from ours import our_system
from support import emit, median, percentile

LEVELS = (10, 1000, 100000)
OTHER_CONSUMERS = 10
OWN_IN_FLIGHT = 16  # what a consumer holding 16 tasks (say, 8 running and 8 prefetched) acks among
ACKS = 3000
LEASE_MS = 600_000
ME = "me"


def enqueue(system, queue: str, count: int) -> None:
    from tasks_app.producer import TaskRequest, enqueue_many

    request = TaskRequest(type="bench.noop", queue=queue)
    for start in range(0, count, 10000):
        enqueue_many([request] * min(10000, count - start), broker=system.broker)


def fill_others(system, queue: str, in_flight: int) -> None:
    """Put `in_flight` tasks of `queue` into the processing lists of OTHER_CONSUMERS live consumers."""
    broker = system.broker
    enqueue(system, queue, in_flight)
    for index in range(OTHER_CONSUMERS):
        consumer_id = f"other-{index}"
        broker.leases.heartbeat([queue], consumer_id, LEASE_MS, {})
        share = in_flight // OTHER_CONSUMERS + (1 if index < in_flight % OTHER_CONSUMERS else 0)
        while share > 0:
            share -= len(broker.queue.claim(queue, consumer_id, min(share, 10000)) or [])


def claim_fenced(system, queue: str, count: int) -> list[tuple[bytes, int]]:
    """Claim up to `count` tasks of `queue` as ME: each with its claim's fencing token."""
    claim = system.broker.queue.claim_with_suspect(queue, ME, count, allow_suspect=False)
    return [] if claim is None else [(raw, claim.first_fence + index) for index, raw in enumerate(claim.tasks)]


def ack_one(system, queue: str, held: list[tuple[bytes, int]]) -> float:
    """Ack our oldest held task of `queue` with its result write, claim a new one; return the ack's seconds."""
    from tasks_app.protocol import records
    from tasks_app.protocol.codec import decode_task

    raw, fence = held.pop(0)
    task = decode_task(raw)
    task.attempt = 1
    update = records.succeeded(task, "true", int(time.time() * 1000), 3600, fence)
    started = time.perf_counter()
    system.broker.queue.ack(queue, ME, [raw], [update])
    elapsed = time.perf_counter() - started
    held.extend(claim_fenced(system, queue, 1))
    return elapsed


if __name__ == "__main__":
    with our_system() as (system, client):
        queues = {level: f"ack{level}" for level in LEVELS}
        held: dict[int, list[tuple[bytes, int]]] = {}
        for level, queue in queues.items():
            fill_others(system, queue, level)
            enqueue(system, queue, ACKS + OWN_IN_FLIGHT)
            system.broker.leases.heartbeat([queue], ME, LEASE_MS, {})
            held[level] = claim_fenced(system, queue, OWN_IN_FLIGHT)
        timings: dict[int, list[float]] = {level: [] for level in LEVELS}
        for _ in range(ACKS):
            for level, queue in queues.items():
                timings[level].append(ack_one(system, queue, held[level]))
    figures = {
        str(level): {"median_us": round(median(t) * 1e6, 1), "p99_us": round(percentile(t, 0.99) * 1e6, 1)}
        for level, t in timings.items()
    }
    medians = [entry["median_us"] for entry in figures.values()]
    emit(
        {
            "bench": "ack_cost",
            "in_flight_elsewhere": figures,
            "own_in_flight": OWN_IN_FLIGHT,
            "max_over_min_median": round(max(medians) / min(medians), 3),
        }
    )
