"""Driver for Celery: task.delay() (no bulk API) and one worker with the threads pool (8)."""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ instead of bench/peers/: this file would otherwise shadow the package it drives.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from peer_system import bin_path, prepare  # noqa: E402
from probe import OPS_KEY  # noqa: E402
from support import Worker  # noqa: E402
from workloads import System, parse_args, run  # noqa: E402

COUNT_RESULTS = "return #redis.call('KEYS', ARGV[1])"
OTHER_KEYS = (
    "celery",
    "unacked",
    "unacked_index",
    "unacked_mutex",
    "_kombu.binding.celery",
    "_kombu.binding.celery.pidbox",
    "_kombu.binding.celeryev",
    "_kombu.binding.reply.celery.pidbox",
    OPS_KEY,
)


class Celery(System):
    name = "celery"
    has_bulk = False
    has_chord = True

    def __init__(self, redis_url: str) -> None:
        super().__init__(redis_url)
        self.env = prepare(redis_url)
        import celery_app

        self.app = celery_app
        self.tasks = {kind: getattr(celery_app, kind) for kind in self.kinds}

    def enqueue_task(self, kind: str = "noop") -> None:
        self.tasks[kind].delay()

    def enqueue_probe(self, enqueued_at: float) -> None:
        self.app.record_start.delay(enqueued_at)

    def enqueue_chord(self, members: int) -> None:
        from celery import chord

        chord(self.tasks["noop"].s() for _ in range(members))(self.app.chord_done.s())

    def start_worker(self) -> Worker:
        return Worker(
            [
                bin_path("celery"),
                "-A",
                "celery_app",
                "worker",
                "-P",
                "threads",
                "-c",
                "8",
                "--without-gossip",
                "--without-mingle",
                "-l",
                "INFO",
            ],
            env=self.env,
            log_name="celery",
        )

    def outstanding(self, client, total: int) -> int:
        # Results are one key each: count them in O(1) as DBSIZE less Celery's few other keys,
        # and check the exact count (O(keys)) only once that says all are done.
        results = int(client.dbsize()) - int(client.exists(*OTHER_KEYS))
        if results >= total:
            results = int(client.eval(COUNT_RESULTS, 0, "celery-task-meta-*"))
        return total - results

    def queue_bytes(self, client) -> int:
        return int(client.memory_usage("celery", samples=0) or 0)


if __name__ == "__main__":
    run(Celery, parse_args())
