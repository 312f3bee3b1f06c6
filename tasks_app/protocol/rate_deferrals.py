"""Bringing the tasks a rate limit deferred to their new slots once the limit changed or was removed.

The decision that finds a type's limiter written under another spacing (`Broker.rate_limit`
answers `rescaled`) has moved the reserved slots in the limiter's hash, and listed every queue
whose delayed set holds tasks with such slots (`P:rate:{T}:follow_ups`; a denial records its
task's queue, whichever it is). A removed limit lists them too (`Broker.rate_removed`), to be due
now. `follow_up` goes through that list once: one consumer at a time holds the lease, the others
wait while queues are listed and take over where a holder that died left off.
"""

from __future__ import annotations

import math
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from itertools import islice

from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import UndecodableTask, decode_task
from tasks_app.protocol.keys import split_delayed_member

# Delayed members read, decoded and moved per round trip while rescheduling.
RESCHEDULE_BATCH = 1000
# How long a follower holds its lease without renewing it (it renews at every batch).
FOLLOWER_LEASE_MS = 30_000


def follow_up(
    broker: Broker, task_type: str, key_token: str | None, give_up: threading.Event, lease_ms: int = FOLLOWER_LEASE_MS
) -> int:
    """Bring the deferred tasks of every queue listed to the limiter's change; how many moved."""
    token, followed = uuid.uuid4().hex, 0
    keep = partial(broker.rate_follower, task_type, key_token, token, lease_ms)
    while broker.rate_follow_ups(task_type, key_token):
        if not keep():
            if give_up.wait(lease_ms / 10_000):  # another follows: wait for it to finish, or to die
                break
            continue
        try:
            # Read again under the lease: the follower that held it last may have done them all meanwhile.
            for queue, mode in broker.rate_follow_ups(task_type, key_token).items():
                since_us = broker.server_time_us()
                reschedule = partial(_reschedule, broker, task_type=task_type, key_token=key_token, now=mode == "now")
                followed += reschedule(queue, keep=keep)
                broker.rate_followed(task_type, key_token, queue, mode, since_us)
        finally:
            broker.rate_follower(task_type, key_token, token, 0)
    return followed


def _reschedule(
    broker: Broker, queue: str, task_type: str, key_token: str | None, *, now: bool, keep: Callable[[], object]
) -> int:
    """Bring the delayed tasks of `task_type` on `queue` holding slots of its limiter to them (`now`: due now).

    `keep` is called at every batch: the follower's lease is renewed there.
    """
    rate_key = broker.keys.rate(task_type, key_token)
    if not broker.client.exists(rate_key):  # no limiter: no task holds a slot of it
        return 0
    now_ms = broker.server_time_ms() if now else None
    moved = 0
    for members in _batches(broker.client.zscan_iter(broker.keys.delayed(queue), count=RESCHEDULE_BATCH)):
        keep()
        ids = _ids_of_type(members, task_type)
        if not ids:
            continue
        slots_us = broker.client.hmget(rate_key, [f"r:{task_id}" for task_id in ids.values()])
        due_ms = {
            member: now_ms if now_ms is not None else math.ceil(int(slot_us) / 1000)
            for member, slot_us in zip(ids, slots_us, strict=True)
            if slot_us is not None
        }
        moved += broker.bring_forward(queue, due_ms)
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
