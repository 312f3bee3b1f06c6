"""What an enqueue leaves in Redis: for tests that claim a rejected request enqueued nothing, or that all was run."""

from __future__ import annotations

from collections.abc import Sequence

from tasks_app.protocol import records
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import decode_payload, decode_task
from tasks_app.protocol.keys import split_delayed_member


def enqueued_keys(broker: Broker) -> list[bytes]:
    """Every key of this test's prefix that an enqueue writes, on any queue: none after a refusal.

    The queue set alone is not enough: a producer that announced a queue lately does not add it
    again for a minute, and a READY record, a waiting mark or a delayed member can be written without it.
    """
    keys = broker.keys
    patterns = [keys.queues(), keys.pending("*"), keys.prioritized("*"), keys.delayed("*"), keys.result("*")]
    patterns.append(keys.waiting("*"))
    return sorted(key for pattern in patterns for key in broker.client.scan_iter(match=pattern, count=1000))


def waiting_count(broker: Broker) -> int:
    """How many waiting marks and READY records of this test's prefix there are (one per waiting task)."""
    client = broker.client
    marks = sum(client.hlen(key) for key in client.scan_iter(match=broker.keys.waiting("*"), count=1000))
    return marks + sum(1 for _ in client.scan_iter(match=broker.keys.result("*"), count=1000))


def waiting_records(broker: Broker, queue: str) -> dict[str, dict[str, str]]:
    """The READY fields of every task waiting in `queue`, by id, as their records read once they start."""
    keys, client = broker.keys, broker.client
    raws = [*client.lrange(keys.pending(queue), 0, -1), *client.zrange(keys.prioritized(queue), 0, -1)]
    raws += [
        split[1] for member in client.zrange(keys.delayed(queue), 0, -1) if (split := split_delayed_member(member))
    ]
    tasks = [decode_task(raw) for raw in raws if raw != b"\x00wake"]
    return {task.id: records.enqueued_fields(task, decode_payload(task.payload)) for task in tasks}


def waiting_record(broker: Broker, task_id: str, queue: str) -> dict[str, str]:
    """A waiting task's READY fields as its record reads once it starts, from its envelope in `queue`."""
    return waiting_records(broker, queue)[task_id]


def file_ready(broker: Broker, task_ids: Sequence[str], queue: str, ttl_s: int = 7 * 24 * 3600) -> None:
    """Write READY records of waiting tasks, filed in the history, as old producers did at enqueue."""
    waiting = waiting_records(broker, queue)
    for task_id in task_ids:
        broker.records.record_result(records.ResultUpdate(task_id, waiting[task_id], ttl_s, queue=queue))
        broker.client.hdel(*broker.keys.waiting_mark(task_id))  # a task with a READY record has no mark
    # In the order given, as enqueues scored them (tasks of one call share their enqueue ms).
    for key in (broker.keys.history(queue), broker.keys.history_status(queue, "READY")) if len(task_ids) > 1 else ():
        scores = broker.client.zmscore(key, list(task_ids))
        ordered = {
            task_id: (score or 0) + at / 1000 for at, (task_id, score) in enumerate(zip(task_ids, scores, strict=True))
        }
        broker.client.zadd(key, ordered, xx=True)


def is_idle(broker: Broker, queues: Sequence[str]) -> bool:
    """True when none of `queues` has anything pending, in flight or delayed."""
    for queue in queues:
        stats = broker.inspect.queue_stats(queue)
        if stats.pending or stats.processing or stats.delayed:
            return False
    return True
