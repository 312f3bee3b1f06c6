"""Reading and tending a queue from outside: stats, live consumers, throughput, charts and the dead letters."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple, cast

import redis
from django.conf import settings

from tasks_app.protocol import history, records
from tasks_app.protocol.codec import Arguments, Task, UndecodableTask, decode_payload, decode_task, encode_task
from tasks_app.protocol.history import KEEP_MINUTES, Records
from tasks_app.protocol.keys import NAME_PATTERN, UNDECODABLE_TYPE, WAKE_TOKEN, delayed_member, split_delayed_member
from tasks_app.protocol.queue import THROUGHPUT_BUCKET_S, Queue
from tasks_app.protocol.records import ResultUpdate, ms_of_score
from tasks_app.protocol.scripts import Role, ScriptClient

# Most dead letters one trim_dead call drops (about 5 ms of Redis time).
TRIM_BATCH = 10_000
# Redis Cluster: how long a requeue parks its tasks in delayed while their READY records are written
# on other masters (a requeuer that dies meanwhile leaves them to be promoted then).
REQUEUE_PARK_MS = 60_000
# What requeue_dead answers per task (else the id of the task holding its uniqueness key: it stays dead).
NOT_MOVED, MOVED, MOVED_WITHOUT_RECORD = 0, 1, 2

logger = logging.getLogger(__name__)

# At most how many dead letters of one ms an action finds: one promotion may dead-letter thousands.
SCAN_PAGE = 500
# A dead letter's ref: the ms it died at, then the SHA-1 of the member.
_REF = re.compile(r"-?[0-9]{1,19}:[0-9a-f]{40}")


class WaitingTask(NamedTuple):
    """A task as it waits in a queue: the part holding it (pending, prioritized, delayed), its bytes, its due ms."""

    queue: str
    part: str
    raw: bytes
    due_ms: float  # delayed only (0: due now)


@dataclass(frozen=True)
class QueueStats:
    """Sizes of one queue's parts, its consumers, and what a scaler reads."""

    queue: str
    pending: int
    processing: int
    delayed: int
    dead: int
    consumers: list[dict[str, Any]]
    paused: bool = False
    waiting: int = 0  # pending and due delayed tasks: what a free worker could start now
    in_flight: int = 0  # in the processing lists of consumers whose lease is alive
    oldest_waiting_age_s: float = 0.0  # how long the next task of each waiting part has waited, the longest
    workers: int = 0  # the worker threads (--concurrency) of consumers whose lease is alive

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class DeadRequeue(NamedTuple):
    """A dead task to move back: its member, priority, task, id, READY record and uniqueness key (window 0: none)."""

    member: bytes
    priority: int
    raw: bytes
    task_id: str
    record: ResultUpdate
    unique_digest: str = ""
    unique_window_ms: int = 0

    def parked(self) -> DeadRequeue:
        """The same task as `requeue_dead` parks it in delayed on Redis Cluster (its key taken by then)."""
        return self._replace(member=delayed_member(self.priority, self.raw), unique_window_ms=0)


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
    died_ms: int = 0
    # What the page shows of it (undecodable bytes: from no task).
    task_id: str = ""
    type: str = UNDECODABLE_TYPE
    attempts: int = 0
    error: str = "not a task envelope"
    reason: str = ""
    traceback: str = ""

    @property
    def ref(self) -> str:
        """A stable handle for the member in forms: when it died (to find it there) and its SHA-1."""
        return f"{self.died_ms}:{hashlib.sha1(self.member).hexdigest()}"

    @property
    def requeueable(self) -> bool:
        """Undecodable bytes kept for inspection can only be deleted."""
        return self.task is not None and self.task.type != UNDECODABLE_TYPE


class Inspection(Role):
    """Queue stats, chart counters and dead-letter operations for the dashboard, the commands and housekeeping."""

    def __init__(self, redis: ScriptClient, queue: Queue, records: Records) -> None:
        super().__init__(redis)
        self.queue = queue
        self.records = records

    def completed_last_minute(self, queue: str) -> int:
        """Count the tasks of `queue` acknowledged in the last minute (whole buckets: 50-60 s)."""
        current = int(time.time()) // THROUGHPUT_BUCKET_S
        buckets = range(current - 60 // THROUGHPUT_BUCKET_S + 1, current + 1)
        # One GET each: a foreign name in the queue set ("", "}x") spreads its keys over a cluster's slots.
        counts = self.redis.each(buckets, lambda pipe, bucket: pipe.get(self.keys.completed(queue, bucket)))
        return sum(int(count or 0) for count in counts)

    def known_queues(self) -> list[str]:
        """Return every queue that has seen a task or a consumer."""
        members = self.client.smembers(self.keys.queues())
        return sorted(member.decode(errors="backslashreplace") for member in members)  # may hold any bytes

    def queue_stats(self, queue: str, now_ms: int | None = None) -> QueueStats:
        """Count a queue's tasks in each part, list its consumers, read the scaler's gauges at server time `now_ms`."""
        now_ms = self.server_time_ms() if now_ms is None else now_ms
        # One MULTI/EXEC reads every count, so a task moved meanwhile is counted once; not for a foreign
        # name in the queue set (its keys may lie in many Redis Cluster slots).
        listing = self.client.pipeline(transaction=False)
        listing.zrange(self.keys.consumers(queue), 0, -1, withscores=True)
        listing.zrange(self.keys.reaped(queue), 0, -1)  # the lists of reaped ids may hold its tasks too
        entries, reaped = listing.execute()
        holders = [member.decode(errors="backslashreplace") for member, _ in entries]
        holders += [member.decode() for member in reaped]
        pipe = self.client.pipeline(transaction=NAME_PATTERN.fullmatch(queue) is not None)
        pipe.hgetall(self.keys.consumer_info(queue))
        for consumer_id in holders:
            pipe.llen(self.keys.processing(queue, consumer_id))
        pipe.llen(self.keys.pending(queue))
        # A wake token is not a task; there is at most one, near the head of pending.
        pipe.lpos(self.keys.pending(queue), WAKE_TOKEN, rank=-1, maxlen=16)
        pipe.zcard(self.keys.prioritized(queue))
        pipe.llen(self.keys.suspects(queue))
        pipe.zcard(self.keys.delayed(queue))
        pipe.zcard(self.keys.dead(queue))
        pipe.exists(self.keys.paused(queue))
        pipe.zcount(self.keys.delayed(queue), "-inf", now_ms)
        self._queue_heads(pipe, queue, now_ms)
        info_raw, *lengths = pipe.execute()
        counts, heads = lengths[len(holders) : len(holders) + 8], lengths[len(holders) + 8 :]
        pending, wake_token_at, prioritized, suspects, delayed, dead, paused, due = counts
        queued = pending - (wake_token_at is not None) + prioritized + suspects
        processing = sum(lengths[: len(holders)])
        infos = {key.decode(errors="backslashreplace"): json.loads(value) for key, value in info_raw.items()}
        consumers = [
            {**infos.get(held_by, {}), "id": held_by, "lease_deadline_ms": int(deadline_ms), "in_flight": count}
            for held_by, (_, deadline_ms), count in zip(holders, entries, lengths[: len(entries)], strict=False)
        ]
        # A consumer past its deadline is dead even before a reaper removed it.
        live = [consumer for consumer in consumers if consumer["lease_deadline_ms"] > now_ms]
        return QueueStats(
            queue,
            queued,
            processing,
            delayed,
            dead,
            consumers,
            bool(paused),
            waiting=queued + due,
            in_flight=sum(consumer["in_flight"] for consumer in live),
            oldest_waiting_age_s=_oldest_waiting_age_s(heads, now_ms),
            workers=sum(consumer.get("concurrency", 0) for consumer in live),
        )

    def _queue_heads(self, pipe: Any, queue: str, now_ms: int) -> None:
        """Queue the reads of the next task of each waiting part (two of pending: a wake token may be its head)."""
        pipe.lrange(self.keys.pending(queue), -2, -1)
        pipe.zrange(self.keys.prioritized(queue), 0, 0)
        pipe.lrange(self.keys.suspects(queue), -1, -1)
        pipe.zrangebyscore(self.keys.delayed(queue), "-inf", now_ms, start=0, num=1, withscores=True)

    def sample_backlog(self, queue: str) -> int | None:
        """Store how many tasks of `queue` wait in this minute's hash, unless one was this minute (then None)."""
        key = self.keys.minute(queue, int(time.time()) // 60)
        parts = self.keys.queue_keys(queue, "pending prioritized suspects delayed")
        pipe = self.client.pipeline(transaction=False)
        pipe.hexists(key, "backlog")
        pipe.exists(*parts)  # an empty queue, most of them, needs no count
        sampled, nonempty = pipe.execute()
        if sampled:
            return None
        backlog = 0
        if nonempty:
            pipe.llen(parts[0])
            pipe.zcard(parts[1])
            pipe.llen(parts[2])
            pipe.zcard(parts[3])
            backlog = int(sum(pipe.execute()))
        pipe.hset(key, "backlog", backlog)
        pipe.expire(key, KEEP_MINUTES * 60)
        pipe.execute()
        return backlog

    def waiting_tasks(self, queues: Sequence[str], offset: int, limit: int) -> tuple[list[WaitingTask], int]:
        """Up to `limit` waiting tasks of `queues` from `offset` on, read from the queues, and how many wait."""
        # Per queue in order: pending newest first, then prioritized highest first, then delayed soonest due.
        parts = [(q, part) for q in queues for part in ("pending", "prioritized", "delayed")]
        pipe = self.client.pipeline(transaction=False)
        for queue, part in parts:
            key = self.keys.queue_key(queue, part)
            pipe.llen(key) if part == "pending" else pipe.zcard(key)
        sizes = [int(size) for size in pipe.execute()]
        slices: list[tuple[str, str, int, int]] = []  # (queue, part, first, last) to read
        skip, left = offset, limit
        for (queue, part), size in zip(parts, sizes, strict=True):
            if skip >= size:
                skip -= size
                continue
            if left > 0:
                take = min(size - skip, left)
                slices.append((queue, part, skip, skip + take - 1))
                left -= take
            skip = 0
        pipe = self.client.pipeline(transaction=False)
        for queue, part, first, last in slices:
            key = self.keys.queue_key(queue, part)
            if part == "pending":
                pipe.lrange(key, first, last)
            else:  # prioritized in claim order (a lower score is a higher priority); delayed soonest due
                pipe.zrange(key, first, last, withscores=part == "delayed")
        found: list[WaitingTask] = []
        for (queue, part, _, _), members in zip(slices, pipe.execute() if slices else [], strict=True):
            for member in members:
                due_ms = 0.0
                if part == "delayed":
                    member, due_ms = member
                    member = (split_delayed_member(member) or (0, b""))[1]
                if member and member != WAKE_TOKEN:
                    found.append(WaitingTask(queue, part, member, due_ms))
        return found, sum(sizes)

    def minute_counts(self, queue: str, minutes: Sequence[int]) -> list[dict[str, int]]:
        """The counters of `queue` for each of `minutes` (empty where nothing was counted)."""
        counters = self.redis.each(minutes, lambda pipe, minute: pipe.hgetall(self.keys.minute(queue, minute)))
        return [{key.decode(): int(value) for key, value in raw.items()} for raw in counters]

    def dead_count(self, queue: str) -> int:
        """How many tasks of `queue` are dead-lettered."""
        return int(self.client.zcard(self.keys.dead(queue)))

    def list_dead(self, queue: str, offset: int = 0, limit: int = 100) -> list[tuple[bytes, int]]:
        """Return dead-lettered tasks of a queue, newest first, with the time (ms) they died."""
        entries = self.client.zrange(self.keys.dead(queue), offset, offset + limit - 1, desc=True, withscores=True)
        return [(member, int(score)) for member, score in entries]

    def requeue_dead(
        self, queue: str, entries: Sequence[DeadRequeue], fence: int, *, parked: bool = False
    ) -> list[int | str]:
        """Move dead tasks back, with READY records: NOT_MOVED, MOVED, MOVED_WITHOUT_RECORD or the key's holder."""
        # On Redis Cluster the records lie in other slots: the tasks are parked in delayed for the caller
        # to write their records, then push them (`parked`: those still parked).
        if not entries:
            return []
        cluster = isinstance(self.client, redis.RedisCluster)
        source = self.keys.delayed(queue) if parked else self.keys.dead(queue)
        park_ms = REQUEUE_PARK_MS if cluster and not parked else 0
        entries = [entry.parked() for entry in entries] if parked else entries
        uniques = [self.keys.unique(queue, e.unique_digest) for e in entries if e.unique_window_ms > 0]
        args: list[Any] = [WAKE_TOKEN, park_ms, fence, len(history.STATUSES), *history.STATUSES, len(uniques)]
        for entry in entries:
            fields = [] if cluster else [part for pair in entry.record.fields.items() for part in pair]
            args += (entry.member, entry.priority, entry.raw, entry.task_id, entry.record.ttl_s)
            args += (entry.unique_window_ms, len(fields) // 2, *fields)
        keys = [source, *self.keys.queue_keys(queue, "pending prioritized cancel_requests cancel_forced delayed")]
        keys += [*history.index_keys(self.keys, queue), *uniques]
        keys += [] if cluster else [self.keys.result(entry.task_id) for entry in entries]
        replies = self.redis.run("requeue_dead", keys, args)
        return [reply if isinstance(reply, int) else reply.decode(errors="backslashreplace") for reply in replies]

    def list_dead_tasks(self, queue: str, offset: int = 0, limit: int = 50) -> list[DeadTask]:
        """Return a page of a queue's dead-lettered tasks, newest first."""
        return [_decode(member, died_ms) for member, died_ms in self.list_dead(queue, offset, limit)]

    def find_dead_tasks(self, queue: str, refs: Iterable[str]) -> list[DeadTask]:
        """Return the dead tasks of `queue` whose refs are given, reading only those that died at the refs' times."""
        wanted = set(refs)
        pipe = self.client.pipeline(transaction=False)
        for ms in sorted({int(ref.partition(":")[0]) for ref in wanted if _REF.fullmatch(ref)}):
            pipe.zrangebyscore(self.keys.dead(queue), ms, ms, start=0, num=SCAN_PAGE, withscores=True)
        found = [_decode(member, int(score)) for entries in pipe.execute() for member, score in entries]
        return list({dead.ref: dead for dead in found if dead.ref in wanted}.values())

    def requeue_dead_tasks(
        self,
        queue: str,
        dead: Sequence[DeadTask],
        unique_windows: Mapping[str, UniqueWindow] | None = None,
        stamp: Callable[[MutableMapping[str, str]], None] = lambda headers: None,
    ) -> Requeued:
        """Move requeueable dead tasks back, with a READY record and uniqueness key (`stamp`: into their headers)."""
        movable = [(item, item.task) for item in dead if item.requeueable and item.task is not None]
        if not movable:
            return Requeued([], [])
        # Taken before the moves, so above every earlier run's token (their late writes are ignored)
        # and below the token of any claim of a task they push.
        fence = self.queue.issue_fence(queue)
        entries = [_requeue(item.member, task, queue, fence, unique_windows or {}, stamp) for item, task in movable]
        # The READY record is written with the move, never for a task the move did not take, and before
        # the push: a claim's receipt must not meet the record of the dead run (a cancel asked of it, say).
        replies = self.requeue_dead(queue, entries, fence)
        for entry, reply in zip(entries, replies, strict=True):
            if reply == MOVED_WITHOUT_RECORD:
                logger.warning("requeued task %s without its READY record: Redis refused it", entry.task_id)
        moved = [reply in (MOVED, MOVED_WITHOUT_RECORD) for reply in replies]
        if isinstance(self.client, redis.RedisCluster):
            self._write_records_and_push(queue, [entry for entry, took in zip(entries, moved, strict=True) if took])
        return Requeued(
            [item for (item, _), took in zip(movable, moved, strict=True) if took],
            [(item, reply) for (item, _), reply in zip(movable, replies, strict=True) if isinstance(reply, str)],
        )

    def _write_records_and_push(self, queue: str, parked: Sequence[DeadRequeue]) -> None:
        """Redis Cluster: write the parked tasks' READY records, on a replica too, then push them."""
        # Else a failover there would bring the dead run's record back under the new run.
        if not parked:
            return
        updates = [entry.record for entry in parked]
        written, unreplicated = self.records.write_on_masters(updates)
        _, written = self.records.execute_with_writes(self.client.pipeline(transaction=False), updates, [], written)
        if unreplicated:
            logger.warning("a replica did not confirm requeued tasks' READY records within the wait; requeued anyway")
        for entry, reply in zip(parked, written, strict=True):
            if isinstance(reply, Exception):
                logger.warning("requeued task %s without its READY record: Redis refused it (%s)", entry.task_id, reply)
        self.requeue_dead(queue, parked, 0, parked=True)

    def delete_dead_tasks(self, queue: str, dead: Sequence[DeadTask]) -> int:
        """Delete dead tasks for good; return how many were deleted."""
        return int(self.client.zrem(self.keys.dead(queue), *(item.member for item in dead))) if dead else 0

    def trim_dead(self, queue: str, max_count: int, max_age_s: int) -> int:
        """Drop the oldest dead letters beyond `max_count` and those older than `max_age_s`; how many."""
        dropped = 0
        while True:
            step = int(self.redis.run("trim_dead", [self.keys.dead(queue)], [max_count, max_age_s * 1000, TRIM_BATCH]))
            dropped += step
            if step < TRIM_BATCH:
                return dropped

    def server_time_ms(self) -> int:
        """Return the Redis server's clock in milliseconds."""
        return self.redis.server_time_us() // 1000

    def ping(self) -> bool:
        """Return True if Redis answers."""
        return bool(self.client.ping())

    def answers(self) -> bool:
        """Whether Redis answers PING and serves every slot (no failover under way); False, not an error, if not."""
        try:
            return self.ping() and self.serves_every_slot()
        except Exception:
            return False

    def serves_every_slot(self) -> bool:
        """False while a Redis Cluster reports a slot unserved (a failover under way); True on a single server."""
        if not isinstance(self.client, redis.RedisCluster):
            return True
        # With several target nodes redis-py answers one parsed CLUSTER INFO per node.
        replies = cast(dict[Any, dict[str, Any]], self.client.cluster_info(target_nodes=redis.RedisCluster.PRIMARIES))
        return all(info.get("cluster_state") == "ok" for info in replies.values())


def _oldest_waiting_age_s(heads: Sequence[Any], now_ms: int) -> float:
    """Seconds the longest-waiting of the parts' next tasks has waited (0: none), from `_queue_heads`' replies."""
    pending, prioritized, suspects, due = heads
    since_ms = [ms_of_score(score) for _, score in due]  # a due delayed task waits from its due time (server clock)
    for raw in [*pending, *prioritized, *suspects]:
        try:
            task = decode_task(raw)
        except UndecodableTask:
            continue  # a wake token, or bytes a consumer will dead-letter
        # From its enqueue or due time, on its producer's clock.
        started_ms = max(task.enqueued_at_ms, task.run_after_ms)
        if started_ms > 0:
            since_ms.append(started_ms)
    return max(0.0, (now_ms - min(since_ms)) / 1000) if since_ms else 0.0


def _decode(member: bytes, died_at_ms: int) -> DeadTask:
    died_at = records.datetime_of_ms(died_at_ms)  # None past the calendar
    try:
        task = decode_task(member)
    except UndecodableTask:
        return DeadTask(member, died_at, None, died_at_ms)
    shown = (task.id, task.type, task.attempt, task.last_error, task.dead_reason, task.last_traceback)
    return DeadTask(member, died_at, task, died_at_ms, *shown)


def _requeue(
    member: bytes,
    task: Task,
    queue: str,
    fence: int,
    windows: Mapping[str, UniqueWindow],
    stamp: Callable[[MutableMapping[str, str]], None],
) -> DeadRequeue:
    """Dead `task` to move back to `queue` afresh (no attempt used, no error, due now) with its READY record."""
    fresh = Task()
    fresh.CopyFrom(task)
    stamp(fresh.headers)
    # A foreign envelope may name no queue, or another: its record belongs to the queue it goes back to.
    fresh.queue, fresh.attempt, fresh.run_after_ms = queue, 0, 0
    for name in ("last_error", "last_traceback", "dead_reason"):
        fresh.ClearField(name)
    try:
        arguments: Arguments | None = decode_payload(fresh.payload)
    except UndecodableTask:
        arguments = None
    fields = records.enqueued_fields(fresh, arguments) if arguments else {"status": records.READY, "attempts": "0"}
    # Empty fields read back as "not set"; a cancel asked of the dead run is void.
    fields.update({"finished_at_ms": "", "run_after_ms": "", "dead_reason": "", "cancel_requested_at_ms": ""})
    unique = windows.get(fresh.type) if fresh.unique_digest else None
    if unique is not None:  # a cancel before it starts frees the key if its end does (see cancel.lua)
        fields["unique_digest"] = fresh.unique_digest if unique.until_finished else ""
    record = ResultUpdate(fresh.id, fields, settings.TASKS_RESULT_TTL, fence=fence, queue=queue, task_type=fresh.type)
    window_ms = unique.window_ms if unique is not None else 0
    return DeadRequeue(member, fresh.priority, encode_task(fresh), fresh.id, record, fresh.unique_digest, window_ms)
