"""Driver for Huey: calling a task enqueues it (no bulk API); one consumer with 8 thread workers."""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ instead of bench/peers/: this file would otherwise shadow the package it drives.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from peer_system import bin_path, prepare  # noqa: E402
from support import Worker  # noqa: E402
from workloads import System, parse_args, run  # noqa: E402


class Huey(System):
    name = "huey"
    has_bulk = False

    def __init__(self, redis_url: str) -> None:
        super().__init__(redis_url)
        self.env = prepare(redis_url)
        import huey_app

        self.app = huey_app
        self.tasks = {kind: getattr(huey_app, kind) for kind in self.kinds}

    def enqueue_task(self, kind: str = "noop") -> None:
        self.tasks[kind]()

    def enqueue_probe(self, enqueued_at: float) -> None:
        self.app.record_start(enqueued_at)

    def start_worker(self) -> Worker:
        return Worker(
            [bin_path("huey_consumer"), "huey_app.huey", "-w", "8", "-k", "thread"], env=self.env, log_name="huey"
        )

    def outstanding(self, client, total: int) -> int:
        return total - int(client.hlen("huey.results.bench"))

    def queue_bytes(self, client) -> int:
        return int(client.memory_usage("huey.redis.bench", samples=0) or 0)


if __name__ == "__main__":
    run(Huey, parse_args())
