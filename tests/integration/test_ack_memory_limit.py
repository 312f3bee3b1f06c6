"""An ack flush that Redis refuses for memory (maxmemory, noeviction) writes nothing at all, not half of it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import redis

from tasks_app.consumer.ack_batcher import AckBatcher
from tasks_app.protocol import results
from tasks_app.protocol.broker import Broker, Enqueueable
from tasks_app.protocol.codec import Arguments, Task, encode_task
from tests.chaos.servers import RedisServer

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
    task = Task(id="full-1", type="demo.echo", queue="q", attempt=1)
    broker.enqueue([Enqueueable(queue="q", raw=encode_task(task))], result_ttl_s=60)
    broker.heartbeat(["q"], "c1", 10_000, {"lease_ms": 10_000})
    claim = broker.claim_with_suspect("q", "c1", 1)
    [raw], fence = claim.tasks, claim.first_fence
    assert broker.record_result(results.started(task, Arguments([], {}), "c1", 1, 3, 60, fence)) == 1
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
