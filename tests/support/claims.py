"""Putting tasks into a queue and into a consumer's hands directly, for unit tests of the consumer."""

from __future__ import annotations

import time
from typing import Any

from tasks_app.protocol import records
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Arguments, Task, encode_task
from tasks_app.protocol.enqueue import Enqueueable


def task_bytes(task_id: str, task_type: str = "test.record", queue: str = "q", **fields: Any) -> bytes:
    """A serialized task, as a producer would push it."""
    return encode_task(Task(id=task_id, type=task_type, queue=queue, **fields))


def push(broker: Broker, *raws: bytes, queue: str = "q") -> None:
    """Enqueue serialized tasks to run now (no READY record)."""
    broker.enqueuer.enqueue([Enqueueable(queue=queue, raw=raw) for raw in raws], result_ttl_s=60)


def register(broker: Broker, consumer_id: str, lease_ms: int, queue: str = "q") -> None:
    """Give a consumer a lease on one queue, as its start does."""
    broker.leases.heartbeat([queue], consumer_id, lease_ms, {"lease_ms": lease_ms})


def claim(broker: Broker, consumer_id: str, count: int, queue: str = "q") -> list[bytes]:
    """Move up to `count` tasks into a registered consumer's processing list."""
    claimed = broker.queue.claim(queue, consumer_id, count)
    assert claimed is not None, f"{consumer_id} holds no lease on {queue}"
    return claimed


def die_running(broker: Broker, consumer_id: str, lease_ms: int, queue: str = "q") -> bytes:
    """Be a consumer that claims the next task (a suspect first), starts it and dies: its lease lapses."""
    register(broker, consumer_id, lease_ms, queue)
    taken = broker.queue.claim_with_suspect(queue, consumer_id, 1)
    assert taken is not None and len(taken.tasks) == 1, f"{consumer_id} found nothing to claim"
    if taken.took_suspect:
        broker.queue.mark_started(queue, consumer_id, taken.tasks[0])  # it was running when its consumer died
    time.sleep(lease_ms / 1000 + 0.02)
    return taken.tasks[0]


def running(broker: Broker, task: Task) -> tuple[Task, bytes, int]:
    """Enqueue `task`, claim it as c1 and write its start: the task, its bytes as claimed and its token."""
    broker.enqueuer.enqueue([Enqueueable(queue=task.queue, raw=encode_task(task))], result_ttl_s=60)
    broker.leases.heartbeat([task.queue], "c1", 10_000, {"lease_ms": 10_000})
    claimed = broker.queue.claim_with_suspect(task.queue, "c1", 1)
    [raw], fence = claimed.tasks, claimed.first_fence
    task.attempt = 1
    assert broker.records.record_result(records.started(task, Arguments([], {}), "c1", 1, 3, 60, fence)) == 1
    return task, raw, fence
