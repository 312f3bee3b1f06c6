"""A consumer on 1, 10, 200 and 1,000 queues: its threads and Redis connections, its idle Redis
commands per second, and the idle pick-up latency of tasks spread over its queues."""

import os
import random
import time
from pathlib import Path

import django_env
from ours import our_system
from probe import LATENCY_KEY
from support import ROOT, Worker, emit, median, percentile, wait_for
from workloads import IDLE_COST_WINDOW_S, IDLE_SETTLE_S, LATENCY_GAP_S, idle_cost

COUNTS = tuple(int(n) for n in os.environ.get("BENCH_QUEUE_COUNTS", "1,10,200,1000").split(","))
PROBES = 100
FIRST_CLAIM_S = 0.05  # a consumer's first claim of each of its queues, at its start, on a loaded machine


def threads_of(pid: int) -> int:
    """The threads a process runs now."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


if __name__ == "__main__":
    figures: dict[str, dict[str, float]] = {}
    with our_system() as (system, client):
        for count in COUNTS:
            queues = [f"q{index}" for index in range(count)]
            ours = int(client.info("clients")["connected_clients"])  # this process's own
            argv = django_env.runconsumer_argv(*(arg for queue in queues for arg in ("--queue", queue)))
            worker = Worker(argv, cwd=ROOT, log_name=f"queues-{count}")
            try:
                last = queues[-1]
                wait_for(
                    lambda last=last: system.broker.inspect.queue_stats(last).consumers,
                    300,
                    f"the consumer on {count} queues did not register",
                    interval_s=0.2,
                )
                time.sleep(IDLE_SETTLE_S + count * FIRST_CLAIM_S)  # every queue's first claim done
                threads = threads_of(worker.pid)
                connections = int(client.info("clients")["connected_clients"]) - ours
                cost = idle_cost(client, [worker], window_s=IDLE_COST_WINDOW_S)
                client.delete(LATENCY_KEY)
                for _ in range(PROBES):
                    queue = random.choice(queues)
                    system.producer.enqueue("bench.probe", [time.time()], queue=queue, broker=system.broker)
                    time.sleep(LATENCY_GAP_S)
                wait_for(lambda: client.llen(LATENCY_KEY) >= PROBES, 30, "probes did not all run")
                samples = [float(value) for value in client.lrange(LATENCY_KEY, 0, -1)]
            finally:
                worker.stop()
            client.flushall()
            figures[str(count)] = {
                "threads": threads,
                "redis_connections": connections,
                "idle_commands_per_s": round(cost["commands_per_s"], 1),
                "latency_p50_ms": round(median(samples), 2),
                "latency_p99_ms": round(percentile(samples, 0.99), 2),
            }
    emit({"bench": "queues", "queues": figures})
