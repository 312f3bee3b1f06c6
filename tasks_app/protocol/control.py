"""Task control in Redis: unique enqueues, cancelling through result records, cancel requests of running tasks.

`ControlOps` is mixed into `Broker`. A cancel is decided on the task's result record (its own
slot), where the RUNNING write that starts a run is decided too (`record_result.lua`), so a
cancel and a start are ordered by Redis: either the cancel comes first and the task never
runs, or the start comes first and the cancel becomes a request to the running handler, which
its consumer reads from the queue's `cancel_requests` (and `cancel_forced`, for a forced cancel:
one round trip per queue, see `cancel_marks`).
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple

import redis

from tasks_app.protocol import batch_args, history
from tasks_app.protocol.announced import AnnouncedQueues
from tasks_app.protocol.batch_args import ENQUEUED_IDS_KEEP_MS, ENQUEUED_IDS_MAX, Enqueueable
from tasks_app.protocol.keys import WAKE_TOKEN
from tasks_app.protocol.names import NAME_PATTERN
from tasks_app.protocol.scripts import ScriptClient

# Cancel requests of running tasks are kept this long (a run outliving it is not told again).
CANCEL_REQUESTS_KEEP_MS = 24 * 3600 * 1000

# Outcomes of a cancel (`CancelReply.outcome`).
CANCELLED = "cancelled"  # it had not started: it never runs, its record reads CANCELLED
REQUESTED = "requested"  # it is running: its handler is asked to stop (context.cancelled)
FINISHED = "finished"  # it had already finished: nothing done
UNKNOWN = "unknown"  # no record of it: nothing done


class CancelMark(IntEnum):
    """What was asked of a running task: nothing, to stop (`context.cancelled`), or to stop by force."""

    NONE = 0
    REQUESTED = 1
    FORCED = 2


class UniqueEnqueueable(NamedTuple):
    """A task to push only if no task of its type and uniqueness key was enqueued within its window."""

    item: Enqueueable
    digest: str  # names the uniqueness key P:{queue}:unique:<digest>
    window_ms: int


class UniqueCalls(NamedTuple):
    """Where `queue_uniques` put its calls in a pipeline: per task its script and its record's write (-1: none)."""

    scripts: list[int]
    records: list[int]
    new_queues: set[str]  # the queues it announces


@dataclass(frozen=True)
class CancelReply:
    """What a cancel did to one task."""

    task_id: str
    outcome: str  # CANCELLED, REQUESTED, FINISHED or UNKNOWN
    queue: str
    status: str  # the record's status after the cancel ("" if unknown)
    at_ms: int  # server time of the cancel (of the first request, for a running task)


def _text(value: Any) -> str:
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else str(value)


class ControlOps(ScriptClient):
    """Unique enqueues, cancels and cancel requests, one round trip each (two for a running task's cancel)."""

    _announced_queues: AnnouncedQueues
    history_max: int  # the cap of each queue's history index (the broker's)

    def queue_uniques(
        self,
        pipe: Any,
        uniques: Sequence[UniqueEnqueueable],
        result_ttl_s: int,
        *,
        first_by_source: bool = False,
        recorded: Set[str] = frozenset(),
    ) -> UniqueCalls:
        """Add the calls of `enqueue_unique` to a pipeline, in order; return where they are (see `unique_holders`).

        `first_by_source`: the first script call is sent as EVAL, which loads it for the others
        in a MULTI/EXEC (where a NOSCRIPT would fail them alone, after the rest has run). On Redis
        Cluster each record is written before its script by `enqueue_batch` (once per id), but for
        the ids in `recorded` (claimed before this pipeline).
        """
        cluster = isinstance(self.client, redis.RedisCluster)
        index = history.header_args(self.history_max, result_ttl_s * 1000)
        calls = UniqueCalls([], [], set())
        recorded = set(recorded)
        for position, unique in enumerate(uniques):
            item = unique.item
            keys = self._unique_keys(unique)
            record: list[str] = []
            if cluster:
                calls.records.append(self._queue_record_beside(pipe, item, result_ttl_s, recorded))
            else:
                calls.records.append(-1)
                record = [pair for field in item.result_key_fields.items() for pair in field]
                keys += [self.keys.result(item.task_id)] if record else []
            args = [item.task_id, unique.window_ms, WAKE_TOKEN, item.priority, item.delay_ms, item.raw]
            args += [result_ttl_s + item.delay_ms // 1000 + 1, "1" if item.idempotent else "0"]
            args += [ENQUEUED_IDS_KEEP_MS, ENQUEUED_IDS_MAX, *index, *record]
            calls.scripts.append(len(pipe))
            self.scripts.queue(pipe, "enqueue_unique", keys, args, by_source=first_by_source and position == 0)
        calls.new_queues.update(self._announced_queues.missing(unique.item.queue for unique in uniques))
        if calls.new_queues:
            self.queue_announce(pipe, calls.new_queues, by_source=first_by_source)
        return calls

    def _unique_keys(self, unique: UniqueEnqueueable) -> list[str]:
        """The KEYS of `unique`'s enqueue_unique call, but for its record."""
        queue = unique.item.queue
        return [
            self.keys.unique(queue, unique.digest),
            self.keys.pending(queue),
            self.keys.prioritized(queue),
            self.keys.delayed(queue),
            self.keys.enqueued(queue),
            *history.index_keys(self.keys, queue),
        ]

    def _queue_record_beside(self, pipe: Any, item: Enqueueable, result_ttl_s: int, recorded: set[str]) -> int:
        """Queue a unique task's READY record on Redis Cluster (once per id); return its place in `pipe` (-1: none)."""
        if not item.result_key_fields or item.task_id in recorded:
            return -1
        recorded.add(item.task_id)
        self._queue_record(pipe, item, result_ttl_s)
        return len(pipe) - 1

    def _queue_record(self, pipe: Any, item: Enqueueable, result_ttl_s: int) -> None:
        """Queue an enqueue_batch call writing `item`'s READY record alone (in its own slot on Redis Cluster)."""
        args = batch_args.record_only_args(item, result_ttl_s)
        self.scripts.queue(pipe, "enqueue_batch", [self.keys.result(item.task_id)], args)

    def unique_holders(self, replies: Sequence[Any], calls: UniqueCalls) -> list[str | None]:
        """Per task None (pushed) or the id enqueued in its place, from the replies of `queue_uniques`'s calls."""
        return [None if int(replies[at][0]) else _text(replies[at][1]) for at in calls.scripts]

    def release_unique(self, queue: str, digest: str, task_id: str, after_ms: int = 0) -> bool:
        """Free a uniqueness key if task `task_id` holds it (in `after_ms`, if its window ends later); True if so."""
        return bool(self._script("release_unique", [self.keys.unique(queue, digest)], [task_id, after_ms]))

    def cancel_many(self, task_ids: Sequence[str], cancelled_by: str = "", force: bool = False) -> list[CancelReply]:
        """Cancel tasks by id, in one round trip (and one more if some are running); never raises for an id.

        With `force`, running ones are also listed in the queue's `cancel_forced`: their consumer
        stops them instead of only telling them (see README, "Cancelling").
        """
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            self.scripts.queue(pipe, "cancel", [self.keys.result(task_id)], [cancelled_by])
        answers = self.scripts.execute(pipe, self.client)
        replies = [
            CancelReply(task_id, _text(outcome), _text(queue), _text(status), int(at_ms))
            for task_id, (outcome, queue, status, at_ms, *_) in zip(task_ids, answers, strict=True)
        ]
        # Only a record naming a queue ours could serve has its queue told: a foreign writer's name
        # ("", "}x") may spread that queue's keys over a cluster's slots, failing every cancel's writes.
        ours = [NAME_PATTERN.fullmatch(reply.queue) is not None for reply in replies]
        running = [reply for reply, known in zip(replies, ours, strict=True) if known and reply.outcome == REQUESTED]
        filed = [
            (reply, _text(answer[4]) if len(answer) > 4 else "")
            for reply, answer, known in zip(replies, answers, ours, strict=True)
            if known and reply.outcome == CANCELLED
        ]
        if running or filed:
            pipe = self.client.pipeline(transaction=False)
            for reply, unique_digest in filed:
                self._file_cancelled(pipe, reply, unique_digest)
            for reply in running:
                self._file_cancel_request(pipe, reply, force)
            self.scripts.execute(pipe, self.client)
        return replies

    def claim_receipts(self, claims: Sequence[tuple[str, int]], result_ttl_s: int) -> list[int]:
        """Write the receipts of claimed tasks, (id, fencing token) each: per task 1 held by that claim,
        3 held, its record created by the receipt, 0 a later claim holds it, 2 cancelled (it must not
        run), -1 its record is not a hash.

        One script for them all on one server; on Redis Cluster, where the records lie in many
        slots, one script per task in one pipeline.
        """
        keys = [self.keys.result(task_id) for task_id, _ in claims]
        if not isinstance(self.client, redis.RedisCluster):
            return [
                int(reply) for reply in self._script("claim_receipts", keys, [result_ttl_s, *(t for _, t in claims)])
            ]
        pipe = self.client.pipeline(transaction=False)
        for key, (_, token) in zip(keys, claims, strict=True):
            self.scripts.queue(pipe, "claim_receipts", [key], [result_ttl_s, token])
        return [int(replies[0]) for replies in self.scripts.execute(pipe, self.client)]

    def _file_cancelled(self, pipe: Any, reply: CancelReply, unique_digest: str) -> None:
        """Queue the writes of a task cancelled outright: its move in the history, and freeing its uniqueness key."""
        # The task browser's history: READY to CANCELLED (another slot than the record).
        args = history.status_move_args(reply.task_id, history.CANCELLED, "", history.INDEX_TTL_S)
        self.scripts.queue(pipe, "history_move", history.index_keys(self.keys, reply.queue), args)
        if unique_digest:  # a key its end frees (unique_until = finished): it ended, it will never run
            self.scripts.queue(pipe, "release_unique", [self.keys.unique(reply.queue, unique_digest)], [reply.task_id])

    def _file_cancel_request(self, pipe: Any, reply: CancelReply, force: bool) -> None:
        """Queue the writes that tell a running task's consumer of its cancel (and trim old requests)."""
        keys = [self.keys.cancel_requests(reply.queue)]
        if force:
            keys.append(self.keys.cancel_forced(reply.queue))
        for key in keys:
            pipe.zadd(key, {reply.task_id: reply.at_ms})
            pipe.zremrangebyscore(key, "-inf", f"({reply.at_ms - CANCEL_REQUESTS_KEEP_MS}")

    def cancel_marks(self, queue: str, task_ids: Sequence[str]) -> list[CancelMark]:
        """What was asked of each of these (running) tasks of `queue`: two ZMSCOREs in one round trip."""
        if not task_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        pipe.zmscore(self.keys.cancel_requests(queue), list(task_ids))
        pipe.zmscore(self.keys.cancel_forced(queue), list(task_ids))
        requested, forced = pipe.execute()
        return [
            CancelMark.FORCED
            if by_force is not None
            else CancelMark.REQUESTED
            if asked is not None
            else CancelMark.NONE
            for asked, by_force in zip(requested, forced, strict=True)
        ]
