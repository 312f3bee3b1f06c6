"""Calls of the broker's scripts shared by the broker contract tests."""

from tasks_app.protocol.codec import Task, decode_task, encode_task
from tasks_app.protocol.enqueue import Enqueueable

LEASE_MS = 200


def make_task(n: int, priority: int = 0, queue: str = "q") -> bytes:
    return encode_task(Task(id=f"task-{n}", type="demo.echo", queue=queue, priority=priority))


def ids(raws):
    return [decode_task(raw).id for raw in raws]


def register(broker, consumer_id: str, lease_ms: int = LEASE_MS, queues=("q",)) -> None:
    broker.leases.heartbeat(list(queues), consumer_id, lease_ms, {"lease_ms": lease_ms})


def push(broker, *raws, queue="q", priority=0, delay_ms=0):
    broker.enqueuer.enqueue(
        [Enqueueable(queue=queue, raw=raw, priority=priority, delay_ms=delay_ms) for raw in raws], result_ttl_s=60
    )


def expire(broker, consumer_id: str, queue: str = "q") -> None:
    """Let a lease lapse without waiting for it."""
    broker.client.zadd(broker.keys.consumers(queue), {consumer_id: 0})


def deleted_before_the_move(monkeypatch, broker, queue: str, task_id: str, shown) -> None:
    """Make another operator delete the dead letter `task_id` of `shown` just before the next requeue moves."""

    [deleted] = [dead for dead in shown if dead.task_id == task_id]
    move = broker.inspect.requeue_dead

    def deleted_first(*args, **kwargs):
        broker.inspect.delete_dead_tasks(queue, [deleted])
        return move(*args, **kwargs)

    monkeypatch.setattr(broker.inspect, "requeue_dead", deleted_first)
