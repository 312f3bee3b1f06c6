"""Periodic runs in tests: the server's current slot, and the runs a queue's pending list holds (oldest first)."""

from __future__ import annotations

from typing import NamedTuple

from tasks_app.periodic.firing import CATCH_UP_HEADER, SCHEDULE_HEADER, SLOT_HEADER
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import decode_task
from tasks_app.protocol.keys import WAKE_TOKEN


def current_slot_ms(broker: Broker) -> int:
    """The latest whole second on the Redis server's clock: a slot of a one-second schedule, due now."""
    seconds, micros = broker.client.time()
    return (seconds * 1000 + micros // 1000) // 1000 * 1000


class PushedRun(NamedTuple):
    """A periodic run waiting in a queue."""

    task_id: str
    schedule: str
    slot_ms: int
    catch_up: bool


def pushed_runs(broker: Broker, queue: str) -> list[PushedRun]:
    """The periodic runs in `queue`'s pending list, in the order consumers would take them."""
    raws = [raw for raw in reversed(broker.client.lrange(broker.keys.pending(queue), 0, -1)) if raw != WAKE_TOKEN]
    runs = []
    for raw in raws:
        task = decode_task(raw)
        headers = dict(task.headers)
        runs.append(
            PushedRun(
                task.id,
                headers.get(SCHEDULE_HEADER, ""),
                int(headers.get(SLOT_HEADER, "-1")),
                CATCH_UP_HEADER in headers,
            )
        )
    return runs
