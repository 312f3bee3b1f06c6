"""Running one claimed task through a real Executor on a real Redis: the executor, its tasks, where they end."""

from __future__ import annotations

import threading
from typing import Any

from tasks_app.consumer.ack_batcher import AckBatcher
from tasks_app.consumer.async_lane import AsyncLane
from tasks_app.consumer.claiming import Claimed
from tasks_app.consumer.executor import Executor
from tasks_app.consumer.gates import RateLimiter
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task, decode_task, encode_arguments, payload_of
from tasks_app.protocol.keys import split_delayed_member
from tasks_app.protocol.records import ResultUpdate
from tasks_app.registry import Registry
from tasks_app.task_types import TaskTypeCache
from tests.support.claims import claim, push, register, task_bytes

CONSUMER = "worker-a"


class FlushedAcks(AckBatcher):
    """An ack batcher with no flusher thread that writes each update and ack in place before returning."""

    def __init__(self, broker: Broker, give_up: threading.Event | None = None) -> None:
        super().__init__(broker, give_up or threading.Event())

    def record(self, update: ResultUpdate) -> None:
        super().record(update)
        self.barrier()

    def ack(self, *args: Any, **kwargs: Any) -> None:
        super().ack(*args, **kwargs)
        self.barrier()


class NoWorkerSlots:
    """The worker room of a consumer that counts none: tasks are claimed and run by hand."""

    def release(self) -> None: ...
    def take_back(self) -> None: ...


def executor_of(
    broker: Broker, registry: Registry, consumer: str, task_types: TaskTypeCache | None = None, **options: Any
) -> Executor:
    """An executor of `registry`'s handlers for `consumer` (`options`: the executor's; unless given, FlushedAcks,
    so that each task off the asyncio lane is settled before `execute` returns, and a lane of 4 seats)."""
    options.setdefault("acks", FlushedAcks(broker))
    options.setdefault("async_lane", AsyncLane(4, NoWorkerSlots()))
    return Executor(broker, registry, task_types or TaskTypeCache(), consumer, result_ttl_s=60, **options)


def make_executor(broker: Broker, registry: Registry, **options: Any) -> Executor:
    """`executor_of` CONSUMER, registered with a 30 s lease on queue q, its rate gate a RateLimiter unless given."""
    register(broker, CONSUMER, lease_ms=30_000)
    options.setdefault("rate_gate", RateLimiter(broker))
    return executor_of(broker, registry, CONSUMER, **options)


def task_type(executor: Executor, name: str, **options: Any) -> None:
    """Create a TaskType row and let the executor see it."""
    TaskType.objects.create(name=name, handler=options.pop("handler", name), queue="q", **options)
    executor.task_types.refresh()


def claimed(
    broker: Broker, task_id: str, task_type_name: str, *args: Any, raw: bytes | None = None, **fields: Any
) -> Claimed:
    """Push one task and claim it for CONSUMER."""
    if raw is None:
        raw = task_bytes(task_id, task_type_name, payload=payload_of(*encode_arguments(list(args), {})), **fields)
    push(broker, raw)
    [taken] = claim(broker, CONSUMER, 1)
    return Claimed("q", CONSUMER, taken)


def dead_tasks(broker: Broker) -> list[Task]:
    return [decode_task(member) for member, _ in broker.inspect.list_dead("q")]


def delayed_tasks(broker: Broker) -> list[tuple[Task, int]]:
    """Tasks in the delayed set with how many ms from now each is due."""
    now_ms = broker.inspect.server_time_ms()
    members = broker.client.zrange(broker.keys.delayed("q"), 0, -1, withscores=True)
    return [(decode_task(split_delayed_member(member)[1]), int(score) - now_ms) for member, score in members]


def assert_let_go(broker: Broker) -> None:
    assert broker.queue.held_by("q", CONSUMER) == [], "the task left the processing list"
