"""Driver for Dramatiq: actor.send() (no bulk API) and one worker process with 8 threads."""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ instead of bench/peers/: this file would otherwise shadow the package it drives.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from peer_system import bin_path, prepare  # noqa: E402
from support import Worker  # noqa: E402
from workloads import System, parse_args, run  # noqa: E402


class Dramatiq(System):
    name = "dramatiq"
    has_bulk = False
    kinds = frozenset({"noop", "redis_op", "async_redis_op"})

    def __init__(self, redis_url: str) -> None:
        super().__init__(redis_url)
        self.env = prepare(redis_url)
        import dramatiq_app

        self.app = dramatiq_app
        self.tasks = {kind: getattr(dramatiq_app, kind) for kind in self.kinds}

    def enqueue_task(self, kind: str = "noop") -> None:
        self.tasks[kind].send()

    def enqueue_probe(self, enqueued_at: float) -> None:
        self.app.record_start.send(enqueued_at)

    def start_worker(self) -> Worker:
        return Worker(
            [bin_path("dramatiq"), "dramatiq_app", "--processes", "1", "--threads", "8"],
            env=self.env,
            log_name="dramatiq",
            # The main process passes SIGTERM on to its worker process; a second one there is a hard
            # exit, which waits forever on the AsyncIO middleware's (non-daemon) event loop thread.
            term_main_only=True,
        )

    def outstanding(self, client, total: int) -> int:
        # A message stays in the .msgs hash until it is acknowledged (after its result is stored).
        return int(client.hlen("dramatiq:default.msgs"))

    def queue_bytes(self, client) -> int:
        return sum(
            int(client.memory_usage(key, samples=0) or 0) for key in ("dramatiq:default", "dramatiq:default.msgs")
        )


if __name__ == "__main__":
    run(Dramatiq, parse_args())
