"""Driver for django-vtasks (Valkey backend): task.enqueue / backend.enqueue_many, one runworker."""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ instead of bench/peers/: this file would otherwise shadow the package it drives.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from peer_system import prepare  # noqa: E402
from support import Worker  # noqa: E402
from workloads import System, parse_args, run  # noqa: E402

WORKER_ID = "bench"


class VTasks(System):
    name = "django-vtasks"
    kinds = frozenset({"noop", "redis_op", "async_redis_op"})

    def __init__(self, redis_url: str) -> None:
        super().__init__(redis_url)
        self.env = {**prepare(redis_url), "DJANGO_SETTINGS_MODULE": "vtasks_site"}
        import os

        os.environ.update(self.env)
        import django

        django.setup()
        import vtasks_tasks
        from django.tasks import task_backends

        self.app = vtasks_tasks
        self.tasks = {kind: getattr(vtasks_tasks, kind) for kind in self.kinds}
        self.backend = task_backends["default"]

    def enqueue_task(self, kind: str = "noop") -> None:
        self.tasks[kind].enqueue()

    def enqueue_tasks(self, count: int, kind: str = "noop") -> None:
        self.backend.enqueue_many([(self.tasks[kind], (), {})] * count)

    def enqueue_probe(self, enqueued_at: float) -> None:
        self.app.record_start.enqueue(enqueued_at)

    def start_worker(self) -> Worker:
        import sys

        return Worker(
            [sys.executable, "-m", "django", "runworker", "--concurrency", "8", "--id", WORKER_ID],
            env=self.env,
            log_name="vtasks",
        )

    def outstanding(self, client, total: int) -> int:
        return int(client.llen("{vt}:q:default")) + int(client.llen(f"{{vt}}:processing:{WORKER_ID}"))

    def queue_bytes(self, client) -> int:
        return int(client.memory_usage("{vt}:q:default", samples=0) or 0)


if __name__ == "__main__":
    run(VTasks, parse_args())
