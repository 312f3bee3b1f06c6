"""Bringing the tasks a rate limit deferred to their new slots once the limit changed.

The decision that finds a type's limiter written under another spacing (`Broker.rate_limit`
answers `rescaled`) has moved the reserved slots in the limiter's hash; the tasks holding them
wait in their queues' delayed sets, due at their old slots. `reschedule_deferred` brings each
one forward to its slot (never later: under a stricter limit a task back early keeps its place).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice

from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import UndecodableTask, decode_task
from tasks_app.protocol.keys import split_delayed_member

# Delayed members read, decoded and moved per round trip while rescheduling.
RESCHEDULE_BATCH = 1000


def reschedule_deferred(
    broker: Broker, queues: Sequence[str], task_type: str, key_token: str | None = None, *, now: bool = False
) -> int:
    """Bring the delayed tasks of `task_type` holding a slot of its limiter forward to that slot; how many moved.

    With `now` (the type's limit was removed), they are all due at once instead.
    """
    rate_key = broker.keys.rate(task_type, key_token)
    if not broker.client.exists(rate_key):  # no limiter: no task holds a slot of it
        return 0
    now_ms = broker.server_time_ms() if now else None
    moved = 0
    for queue in queues:
        delayed = broker.keys.delayed(queue)
        for members in _batches(broker.client.zscan_iter(delayed, count=RESCHEDULE_BATCH)):
            ids = _ids_of_type(members, task_type)
            if not ids:
                continue
            slots_us = broker.client.hmget(rate_key, [f"r:{task_id}" for task_id in ids.values()])
            due_ms = {
                member: now_ms if now_ms is not None else math.ceil(int(slot_us) / 1000)
                for member, slot_us in zip(ids, slots_us, strict=True)
                if slot_us is not None and slot_us.isdigit()
            }
            if due_ms:  # XX: a task promoted or claimed meanwhile is not added back; LT: never later
                moved += int(broker.client.zadd(delayed, due_ms, xx=True, lt=True, ch=True))
    return moved


def _batches(members: Iterable[tuple[bytes, float]]) -> Iterator[list[bytes]]:
    """The delayed members of a scan, RESCHEDULE_BATCH at a time."""
    names = (member for member, _ in members)
    while batch := list(islice(names, RESCHEDULE_BATCH)):
        yield batch


def _ids_of_type(members: list[bytes], task_type: str) -> dict[bytes, str]:
    """The task id of each delayed member that is a task of `task_type` (other members skipped)."""
    ids = {}
    for member in members:
        split = split_delayed_member(member)
        if split is None:
            continue
        try:
            task = decode_task(split[1])
        except UndecodableTask:
            continue
        if task.type == task_type:
            ids[member] = task.id
    return ids
