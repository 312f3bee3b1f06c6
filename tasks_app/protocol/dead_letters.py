"""Dead-lettered tasks as the dashboard sees them: listing, requeueing and deleting."""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

import redis
from django.conf import settings

from tasks_app.protocol import records
from tasks_app.protocol.broker import Broker, get_broker
from tasks_app.protocol.codec import Task, UndecodableTask, decode_payload, decode_task, encode_task
from tasks_app.protocol.inspection import MOVED, MOVED_WITHOUT_RECORD, DeadRequeue
from tasks_app.protocol.keys import UNDECODABLE_TYPE
from tasks_app.protocol.records import ResultUpdate, datetime_of_ms

logger = logging.getLogger(__name__)

# At most how many dead letters of one time (ms) an action finds: one promotion may dead-letter thousands.
SCAN_PAGE = 500
# A dead letter's ref: the ms it died at (list_dead's reading of its score), then the SHA-1 of the member.
_REF = re.compile(r"-?[0-9]{1,19}:[0-9a-f]{40}")


class UniqueWindow(NamedTuple):
    """A unique task type's uniqueness window (ms, more than 0), and whether a task's end frees its key."""

    window_ms: int
    until_finished: bool


class Requeued(NamedTuple):
    """What a requeue did: the dead tasks moved back, and those left dead, each with the id holding its key."""

    moved: list[DeadTask]
    held: list[tuple[DeadTask, str]]


@dataclass(frozen=True)
class DeadTask:
    """One member of a queue's dead-letter set, decoded for display."""

    member: bytes
    died_at: datetime | None
    task: Task | None
    died_ms: int = 0  # its score, as list_dead reads it

    @property
    def ref(self) -> str:
        """A stable handle for the member in forms: when it died (to find it there) and its SHA-1."""
        return f"{self.died_ms}:{hashlib.sha1(self.member).hexdigest()}"

    @property
    def task_id(self) -> str:
        return self.task.id if self.task else ""

    @property
    def type(self) -> str:
        return self.task.type if self.task else UNDECODABLE_TYPE

    @property
    def attempts(self) -> int:
        return self.task.attempt if self.task else 0

    @property
    def error(self) -> str:
        return self.task.last_error if self.task else "not a task envelope"

    @property
    def reason(self) -> str:
        return self.task.dead_reason if self.task else ""

    @property
    def traceback(self) -> str:
        return self.task.last_traceback if self.task else ""

    @property
    def requeueable(self) -> bool:
        """Undecodable bytes kept for inspection can only be deleted."""
        return self.task is not None and self.task.type != UNDECODABLE_TYPE


def _decode(member: bytes, died_at_ms: int) -> DeadTask:
    try:
        task: Task | None = decode_task(member)
    except UndecodableTask:
        task = None
    return DeadTask(member, datetime_of_ms(died_at_ms), task, died_at_ms)  # None past the calendar


def list_dead_tasks(queue: str, offset: int = 0, limit: int = 50, broker: Broker | None = None) -> list[DeadTask]:
    """Return a page of a queue's dead-lettered tasks, newest first."""
    return [
        _decode(member, died_ms) for member, died_ms in (broker or get_broker()).inspect.list_dead(queue, offset, limit)
    ]


def find_dead_tasks(queue: str, refs: Iterable[str], broker: Broker | None = None) -> list[DeadTask]:
    """Return the dead tasks of `queue` whose refs are given (those no longer dead are left out).

    Each ref names when its task died, so only the tasks that died then are read, never the whole set.
    """
    wanted = set(refs)
    died_ms = sorted({int(ref.partition(":")[0]) for ref in wanted if _REF.fullmatch(ref)})
    scored = (broker or get_broker()).inspect.dead_scored(queue, died_ms, SCAN_PAGE) if died_ms else []
    found = [dead for dead in (_decode(member, ms) for member, ms in scored) if dead.ref in wanted]
    return list({dead.ref: dead for dead in found}.values())


def fresh_copy(task: Task, queue: str) -> Task:
    """Return the task as it should start again on `queue`: no attempts used, no error, due at once."""
    fresh = Task()
    fresh.CopyFrom(task)
    fresh.attempt = 0
    # A foreign envelope a reaper dead-lettered as pushed may name no queue, or another: its READY
    # record and history belong to the queue it goes back to, as a consumer would file it.
    fresh.queue = queue
    fresh.run_after_ms = 0
    for name in ("last_error", "last_traceback", "dead_reason"):
        fresh.ClearField(name)
    return fresh


def requeue(
    queue: str,
    dead: Sequence[DeadTask],
    broker: Broker | None = None,
    unique_windows: Mapping[str, UniqueWindow] | None = None,
) -> Requeued:
    """Move requeueable dead tasks back, with their priority and a READY record; say which moved, which not.

    A task no longer dead (another operator requeued or deleted it, the trim dropped it) is
    skipped, and its record left alone: it may belong to a newer run. A record Redis refuses (a
    producer's record of another type) is logged; its task and the others are requeued all the same. A task of
    a type in `unique_windows` (by type name: those unique) takes its uniqueness key in the move,
    as an enqueue would; while another task holds the key it stays dead, reported in `held`.
    """
    broker = broker or get_broker()
    movable = [(item, fresh_copy(item.task, queue)) for item in dead if item.requeueable and item.task is not None]
    if not movable:
        return Requeued([], [])
    # Taken before the moves, so above every earlier run's token (their late writes are ignored)
    # and below the token of any claim of a task they push.
    fence = broker.queue.issue_fence(queue)
    entries = [_entry(item, task, fence, unique_windows or {}) for item, task in movable]
    # The READY record is written with the move, never for a task the move did not take. It must
    # be there before the push: a consumer may claim the task the moment it is pushed, and its
    # receipt must not meet the record of the dead run (a cancel asked of it, say).
    replies = broker.inspect.requeue_dead(queue, entries, fence)
    for entry, reply in zip(entries, replies, strict=True):
        if reply == MOVED_WITHOUT_RECORD:
            logger.warning("requeued task %s without its READY record: Redis refused it", entry.task_id)
    moved = [reply in (MOVED, MOVED_WITHOUT_RECORD) for reply in replies]
    if isinstance(broker.client, redis.RedisCluster):
        _push_parked(broker, queue, [entry for entry, took in zip(entries, moved, strict=True) if took])
    return Requeued(
        [item for (item, _), took in zip(movable, moved, strict=True) if took],
        [(item, reply) for (item, _), reply in zip(movable, replies, strict=True) if isinstance(reply, str)],
    )


def _entry(item: DeadTask, task: Task, fence: int, unique_windows: Mapping[str, UniqueWindow]) -> DeadRequeue:
    """The requeue of `item` as `task`, taking its uniqueness key if its type is unique and its envelope names one."""
    unique = unique_windows.get(task.type) if task.unique_digest else None
    record = _ready_again(task, fence, unique)
    window_ms = unique.window_ms if unique is not None else 0
    return DeadRequeue(item.member, task.priority, encode_task(task), task.id, record, task.unique_digest, window_ms)


def _push_parked(broker: Broker, queue: str, parked: Sequence[DeadRequeue]) -> None:
    """Redis Cluster: write the READY records of the tasks `requeue_dead` parked in delayed, then push them.

    A record lies on another master than the queue: a replica has it before the push, or a
    failover there would bring the dead run's record back under the new run.
    """
    if not parked:
        return
    written, unreplicated = broker.records.record_results_replicated([entry.record for entry in parked])
    if unreplicated:
        logger.warning("a replica did not confirm requeued tasks' READY records within the wait; requeued anyway")
    for entry, reply in zip(parked, written, strict=True):
        if isinstance(reply, Exception):
            logger.warning("requeued task %s without its READY record: Redis refused it (%s)", entry.task_id, reply)
    broker.inspect.push_parked(queue, parked)


def _ready_again(task: Task, fence: int, unique: UniqueWindow | None) -> ResultUpdate:
    try:
        arguments = decode_payload(task.payload)
    except UndecodableTask:
        arguments = None
    fields = records.enqueued_fields(task, arguments) if arguments else {"status": records.READY, "attempts": "0"}
    # record_result cannot delete fields; empty ones read back as "not set".
    # A requeue starts afresh: a cancel requested of an earlier run no longer applies.
    fields.update({"finished_at_ms": "", "run_after_ms": "", "dead_reason": "", "cancel_requested_at_ms": ""})
    if unique is not None:  # a cancel before it starts frees the key it takes if its end does (see cancel.lua)
        fields["unique_digest"] = task.unique_digest if unique.until_finished else ""
    return ResultUpdate(task.id, fields, settings.TASKS_RESULT_TTL, fence=fence, queue=task.queue, task_type=task.type)


def delete(queue: str, dead: Sequence[DeadTask], broker: Broker | None = None) -> int:
    """Delete dead tasks for good; return how many were deleted."""
    return (broker or get_broker()).inspect.delete_dead(queue, [item.member for item in dead])
