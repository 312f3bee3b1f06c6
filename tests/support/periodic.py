"""Periodic runs in tests: the server's current slot, the runs a queue's pending list holds (oldest first), a move."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from tasks_app.periodic.config import PeriodicConfig
from tasks_app.periodic.firing import CATCH_UP_HEADER, SCHEDULE_HEADER, SLOT_HEADER, fire_slot
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import decode_task
from tasks_app.protocol.keys import WAKE_TOKEN
from tasks_app.protocol.periodic import SlotFiring


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


class Fired(NamedTuple):
    """A periodic run found in a queue."""

    queue: str
    slot_ms: int
    catch_up: bool = False


def fire_around_a_queue_move(
    broker: Broker, config: PeriodicConfig, old: str, new: str
) -> tuple[list[Fired], list[Fired]]:
    """Fire four hourly slots of a catch-up-once schedule moved from queue `old` to `new` after the first,
    alternately by consumers on the rows as read before and after the move.

    Returns each slot where it was fired, and the runs the queues hold, by slot.
    """
    hour_ms = current_slot_ms(broker) // 3_600_000 * 3_600_000
    before = replace(config, queue=old, catch_up="once", saved_ms=hour_ms - 36_000_000)
    after = replace(before, queue=new, saved_ms=hour_ms - 9_000_000)  # between the first two slots
    fired = [Fired(queue, hour_ms - 3_600_000 * (3 - n)) for n, queue in enumerate([old, new, old, new])]
    for snapshot, (_, slot_ms, _) in zip([before, after, before, after], fired, strict=True):
        # On time for hours (the server's clock decides), so each slot is fired as when it came.
        fire_slot(snapshot, SlotFiring(slot_ms, slot_ms - 3_600_000, 36_000_000, "once", snapshot.saved_ms), broker)
    runs = [Fired(queue, run.slot_ms, run.catch_up) for queue in (old, new) for run in pushed_runs(broker, queue)]
    return fired, sorted(runs, key=lambda run: run.slot_ms)
