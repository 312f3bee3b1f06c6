"""Driver for RQ: Queue.enqueue / enqueue_many (one pipeline) and one SimpleWorker."""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ instead of bench/peers/: this file would otherwise shadow the package it drives.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from peer_system import bin_path, prepare  # noqa: E402
from support import Worker  # noqa: E402
from workloads import System, parse_args, run  # noqa: E402


class RQ(System):
    name = "rq"

    def __init__(self, redis_url: str) -> None:
        super().__init__(redis_url)
        self.env = prepare(redis_url)
        from redis import Redis
        from rq import Queue

        self.queue_class = Queue
        self.queue = Queue("default", connection=Redis.from_url(redis_url))

    def enqueue_task(self, kind: str = "noop") -> None:
        self.queue.enqueue(f"probe.{kind}")

    def enqueue_tasks(self, count: int, kind: str = "noop") -> None:
        self.queue.enqueue_many([self.queue_class.prepare_data(f"probe.{kind}") for _ in range(count)])

    def enqueue_probe(self, enqueued_at: float) -> None:
        self.queue.enqueue("probe.record_start", enqueued_at)

    def start_worker(self) -> Worker:
        return Worker(
            [bin_path("rq"), "worker", "--worker-class", "rq.SimpleWorker", "--url", self.redis_url, "default"],
            env=self.env,
            log_name="rq",
        )

    def outstanding(self, client, total: int) -> int:
        return total - int(client.zcard("rq:finished:default"))

    def queue_bytes(self, client) -> int:
        # A queued RQ task is its job hash plus its id in the queue list.
        return sum(int(client.memory_usage(key, samples=0) or 0) for key in client.scan_iter("rq:*", count=1000))


if __name__ == "__main__":
    run(RQ, parse_args())
