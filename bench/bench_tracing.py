"""Tracing's cost: the same drain without the `otel` extra, with the API but no SDK, and with the SDK recording.

Every task carries a sampled `traceparent`, as from a traced web request. The traced consumer records a
`process` span per run through a BatchSpanProcessor into an exporter that drops them (bench/otel_sdk.py).
The three consumers take turns, ROUNDS times; each figure is the best of its rounds (the machine is shared).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis

import django_env
from peers.ours import QUEUE, Ours
from support import ROOT, Worker, emit, redis_server
from workloads import Sizes, run_drain

ROUNDS = 3
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
# How each consumer is started: the environment it gets on top of the bench's.
CONSUMERS: dict[str, dict[str, str]] = {
    "without_extra": {"PYTHONPATH": os.pathsep.join([str(ROOT / "bench" / "without_otel"), str(ROOT)])},
    "api_without_sdk": {},
    "sdk_batch_noop_exporter": {"TASK_HANDLER_MODULES": "bench.handlers,bench.otel_sdk"},
}


class TracedProducer(Ours):
    """Our queue: tasks enqueued with a trace context, drained by a consumer started with `env`."""

    def __init__(self, redis_url: str, env: dict[str, str]) -> None:
        super().__init__(redis_url)
        self.env = env

    def enqueue_tasks(self, count: int, kind: str = "noop") -> None:
        request = self.producer.TaskRequest(type=f"bench.{kind}", queue=QUEUE, headers={"traceparent": TRACEPARENT})
        self.producer.enqueue_many([request] * count, broker=self.broker)

    def start_worker(self) -> Worker:
        consumer_id = f"bench-{len(self.consumer_ids) + 1}"
        self.consumer_ids.append(consumer_id)
        argv = django_env.runconsumer_argv("--queue", QUEUE, "--consumer-id", consumer_id)
        return Worker(argv, env=self.env, cwd=ROOT, log_name=consumer_id)


def figures(url: str, tasks: int) -> dict[str, Any]:
    """The best drain rate of each consumer over ROUNDS turns, and the traced one's cost against the others."""
    best: dict[str, int] = {}
    for _ in range(ROUNDS):
        for name, env in CONSUMERS.items():
            rate = run_drain(TracedProducer(url, env), redis.Redis.from_url(url), Sizes(drain=tasks))["drain_per_s"]
            best[name] = max(best.get(name, 0), rate)
    return {
        "bench": "tracing",
        "tasks": tasks,
        "rounds": ROUNDS,
        "drain_per_s": best,
        "api_without_sdk_vs_without_extra": round(best["api_without_sdk"] / best["without_extra"], 3),
        "sdk_vs_without_extra": round(best["sdk_batch_noop_exporter"] / best["without_extra"], 3),
    }


if __name__ == "__main__":
    with redis_server() as server:
        emit(figures(server.url, int(os.environ.get("BENCH_TRACING_TASKS", "20000"))))
