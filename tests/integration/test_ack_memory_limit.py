"""Writes Redis refuses for memory (maxmemory, noeviction): no half of an ack flush lands, a retry is moved alone."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tasks_app.consumer.ack_batcher import AckBatcher
from tasks_app.consumer.claiming import Claimed
from tasks_app.models import TaskType
from tasks_app.protocol import records
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task, decode_task
from tasks_app.protocol.keys import split_delayed_member
from tasks_app.registry import Handler, Registry
from tests.chaos.servers import RedisServer
from tests.support.claims import running
from tests.support.executing import executor_of

pytestmark = pytest.mark.django_db


def test_an_ack_refused_for_memory_leaves_its_task_listed_and_its_record_as_it_was(tmp_path: Path):
    # Redis refuses every command queued in a MULTI over maxmemory: the transaction aborts whole,
    # so no ack lands without its record (the task runs again once returned) and no record without its ack.
    server = RedisServer(tmp_path).start()
    try:
        _refused_for_memory(redis.Redis.from_url(server.url))
    finally:
        server.remove()


def _refused_for_memory(client: redis.Redis) -> None:
    broker = Broker(client, "P")
    task, raw, fence = running(broker, Task(id="full-1", type="demo.echo", queue="q"))
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)

    batcher = AckBatcher(broker, threading.Event())
    outcome: list[bool | None] = []
    batcher.ack("q", "c1", raw, records.succeeded(task, '"done"', 5, 60, fence, 0.1), outcome.append)
    assert batcher.flush_once(block_s=0.1) == 1
    client.config_set("maxmemory", 0)

    assert outcome == [None]  # unknown to the consumer: the list still holds the task
    assert client.lrange(broker.keys.processing("q", "c1"), 0, -1) == [raw]
    record = broker.records.get_result(task.id)
    assert record["status"] == "RUNNING" and "return_value" not in record
    assert broker.queue.ack("q", "c1", [raw]) == [True]  # what is listed can still be settled


def test_a_task_acked_alone_for_memory_still_gets_its_record(tmp_path: Path):
    # A large task sits twice in its flush (its held record write and its ack): Redis, near its
    # maxmemory, refuses that MULTI each time, then the one with the FAILED record, yet takes the
    # ack alone. The ack found the task, so the run held it: its result is written after the ack.
    server = RedisServer(tmp_path).start()
    try:
        client = redis.Redis.from_url(server.url)
        broker = Broker(client, "P")
        task, raw, fence = running(broker, Task(id="big-1", type="demo.echo", queue="q", payload=b"x" * 1_000_000))
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 1_500_000)
        batcher = AckBatcher(broker, threading.Event())
        outcome: list[bool | None] = []
        batcher.ack("q", "c1", raw, records.succeeded(task, '"done"', 5, 60, fence, 0.1), outcome.append)
        assert batcher.flush_once(block_s=0.1) == 1
        client.config_set("maxmemory", 0)

        assert outcome == [True] and client.llen(broker.keys.processing("q", "c1")) == 0
        record = broker.records.get_result(task.id)
        assert (record["status"], record["return_value"]) == (records.SUCCESSFUL, '"done"')
        assert int(client.hget(broker.keys.minute("q", int(time.time()) // 60), "ok") or 0) == 1
    finally:
        server.remove()


def test_a_retry_refused_for_memory_with_its_record_is_moved_alone_and_the_worker_goes_on(tmp_path: Path):
    # Redis stays over maxmemory after a run failed: its retry (record and move in one MULTI) is
    # refused every time. Bounded like an ack: after a few refusals with Redis answering, the move
    # goes alone (a script whose first write takes the task out of the list is let through), the
    # record after it; the task waits for its retry as planned, and the worker goes on.
    with _filled_by_a_run(tmp_path) as client:
        keys = Broker(client, "P").keys
        assert client.llen(keys.processing("q", "c1")) == 0 and client.zcard(keys.dead("q")) == 0
        [member] = client.zrange(keys.delayed("q"), 0, -1)
        retried = decode_task(split_delayed_member(member)[1])
        assert (retried.id, retried.attempt) == ("filled-1", 1)
        assert retried.last_error == "builtins.ValueError: failed with Redis full"


@contextlib.contextmanager
def _filled_by_a_run(tmp_path: Path) -> Iterator[redis.Redis]:
    """Run a task whose handler puts its private Redis over maxmemory, then fails; yield the client."""
    server = RedisServer(tmp_path).start()
    try:
        client = redis.Redis.from_url(server.url)
        broker = Broker(client, "P")
        registry = Registry()
        registry.add(Handler("x.fills", lambda: _fill(client)))
        TaskType.objects.create(name="x.fills", handler="x.fills", queue="q", max_attempts=3)
        give_up = threading.Event()
        acks = AckBatcher(broker, give_up)
        executor = executor_of(broker, registry, "c1", acks=acks, give_up=give_up)
        _, raw, fence = running(broker, Task(id="filled-1", type="x.fills", queue="q"))
        settled: list[bool] = []
        worker = threading.Thread(target=lambda: settled.append(executor.execute(Claimed("q", "c1", raw, fence=fence))))
        worker.start()
        worker.join(timeout=30)
        give_up.set()
        worker.join()
        client.config_set("maxmemory", 0)
        assert settled == [False], "the worker retried the refused write until told to stop"
        yield client
    finally:
        server.remove()


def _fill(client: redis.Redis) -> None:
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)
    raise ValueError("failed with Redis full")
