"""Driver for this project's queue: `producer.enqueue` / `enqueue_many` and one `runconsumer`."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

import django_env
from support import ROOT, Worker
from workloads import System, parse_args, run

QUEUE = "default"


class Ours(System):
    """This project: one runconsumer with its default concurrency (8) and automatic prefetch."""

    name = "ours"
    has_chord = True
    kinds = frozenset({"noop", "redis_op", "async_redis_op"})

    def __init__(self, redis_url: str) -> None:
        super().__init__(redis_url)
        django_env.setup(redis_url)
        from tasks_app import producer
        from tasks_app.protocol.broker import get_broker

        self.producer = producer
        self.broker = get_broker()
        self.consumer_ids: list[str] = []

    def enqueue_task(self, kind: str = "noop") -> None:
        self.producer.enqueue(f"bench.{kind}", queue=QUEUE, broker=self.broker)

    def enqueue_tasks(self, count: int, kind: str = "noop") -> None:
        request = self.producer.TaskRequest(type=f"bench.{kind}", queue=QUEUE)
        self.producer.enqueue_many([request] * count, broker=self.broker)

    def enqueue_probe(self, enqueued_at: float) -> None:
        self.producer.enqueue("bench.probe", [enqueued_at], queue=QUEUE, broker=self.broker)

    def enqueue_chord(self, members: int) -> None:
        from tasks_app.workflows import chord

        member = self.producer.TaskRequest(type="bench.noop", queue=QUEUE)
        callback = self.producer.TaskRequest(type="bench.chord_done", queue=QUEUE)
        chord([member] * members, then=callback).enqueue(broker=self.broker)

    def start_worker(self) -> Worker:
        consumer_id = f"bench-{len(self.consumer_ids) + 1}"
        self.consumer_ids.append(consumer_id)
        return Worker(
            django_env.runconsumer_argv("--queue", QUEUE, "--consumer-id", consumer_id), cwd=ROOT, log_name=consumer_id
        )

    def outstanding(self, client: redis.Redis, total: int) -> int:
        # Results are written in the same round trip as the ack, just before it: a task that
        # left both lists is done, acknowledged and recorded.
        with client.pipeline(transaction=False) as pipe:
            pipe.llen(self.broker.keys.pending(QUEUE))
            for consumer_id in self.consumer_ids:
                pipe.llen(self.broker.keys.processing(QUEUE, consumer_id))
            return sum(pipe.execute())

    def queue_bytes(self, client: redis.Redis) -> int:
        return int(client.memory_usage(self.broker.keys.pending(QUEUE), samples=0) or 0)


if __name__ == "__main__":
    run(Ours, parse_args())
