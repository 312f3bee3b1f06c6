"""An ack flush that Redis refuses for memory (maxmemory, noeviction) writes nothing at all, not half of it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis

from tasks_app.consumer.ack_batcher import AckBatcher
from tasks_app.protocol import results
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task
from tests.chaos.servers import RedisServer
from tests.support.claims import running

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
    batcher.ack("q", "c1", raw, results.succeeded(task, '"done"', 5, 60, fence, 0.1), outcome.append)
    assert batcher.flush_once(block_s=0.1) == 1
    client.config_set("maxmemory", 0)

    assert outcome == [None]  # unknown to the consumer: the list still holds the task
    assert client.lrange(broker.keys.processing("q", "c1"), 0, -1) == [raw]
    record = broker.get_result(task.id)
    assert record["status"] == "RUNNING" and "return_value" not in record
    assert broker.ack("q", "c1", [raw]) == [True]  # what is listed can still be settled


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
        batcher.ack("q", "c1", raw, results.succeeded(task, '"done"', 5, 60, fence, 0.1), outcome.append)
        assert batcher.flush_once(block_s=0.1) == 1
        client.config_set("maxmemory", 0)

        assert outcome == [True] and client.llen(broker.keys.processing("q", "c1")) == 0
        record = broker.get_result(task.id)
        assert (record["status"], record["return_value"]) == (results.SUCCESSFUL, '"done"')
        assert int(client.hget(broker.keys.minute("q", int(time.time()) // 60), "ok") or 0) == 1
    finally:
        server.remove()
