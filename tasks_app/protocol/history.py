"""Result records in Redis: written, filed in the queue's history index, counted in the charts, read back, cancelled.

On one server record_result files and counts a write itself; on Redis Cluster (the record in another
slot) `history_move` and the counters go in the same round trip, and each master WAITs for a replica.
A cancel and a run's start are both decided on the task's record: either the task never runs, or the
cancel becomes a request its consumer reads from `cancel_requests` (and `cancel_forced`).
"""

from __future__ import annotations

import bisect
import functools
import json
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait as wait_for
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple

import redis
from django.tasks import TaskResultStatus
from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    ClusterError,
    ConnectionError as RedisConnectionError,
    NoScriptError,
    ReadOnlyError,
    TimeoutError as RedisTimeoutError,
    TryAgainError,
)

from tasks_app.protocol import records
from tasks_app.protocol.codec import is_utf8_encodable
from tasks_app.protocol.keys import NAME_PATTERN, Keys, split_waiting_mark
from tasks_app.protocol.records import ResultUpdate, record_text_fields
from tasks_app.protocol.scripts import Role, ScriptClient, reply_text

STATUSES: tuple[str, ...] = (*(status.value for status in TaskResultStatus), records.CANCELLED)
HISTORY_MAX = 100_000
# Time to live of index keys, and of a record a cancel makes from a waiting mark, where the result TTL is not
# at hand; consumers (the drop of the cancelled task) set it again soon.
INDEX_TTL_S = 7 * 24 * 3600
# What delete_finished answers per task: no record, deleted, kept (see lua/delete_finished.lua).
GONE, DELETED, KEPT = 0, 1, 2

KEEP_MINUTES = 120
# Upper bounds of the duration buckets (ms); the last bucket holds everything slower.
DURATION_BUCKETS_MS: tuple[float, ...] = (
    1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 300000,
)  # fmt: skip
OUTCOMES = ("ok", "failed", "retried")

# Redis Cluster: how long a master's WAIT for a replica may take, and how often its replica count is read.
CLUSTER_WAIT_MS = 100
REPLICA_CHECK_S = 10.0

# At most how many records one record_result call writes: a call holds Redis for its whole length.
RECORDS_PER_CALL = 128
# What record_result answers for a held write whose task the consumer no longer holds (not written).
NOT_HELD = 3
# What record_result answers for a write the record already holds (sent again after a lost reply).
WRITTEN_AGAIN = 4

# Where a result write's reply is: its call's place in a pipeline, its index in that call's reply.
Place = tuple[int, int]

# Replies of a master that is failing over, moved a slot or was demoted: write the results again.
_NODE_STATE_REPLIES = (AskError, ClusterDownError, TryAgainError, ReadOnlyError, BusyLoadingError)


class Entry(NamedTuple):
    """One task of a history index: its queue, id and enqueue time (epoch ms)."""

    queue: str
    task_id: str
    score_ms: float


@functools.lru_cache(maxsize=4096)  # built for every result write: once per queue instead
def index_keys(keys: Keys, queue: str) -> tuple[str, ...]:
    """The keys of `queue`'s history, as the scripts take them: all, ids, then one per status."""
    return (keys.history(queue), keys.history_ids(queue), *(keys.history_status(queue, s) for s in STATUSES))


def header_args(history_max: int, ttl_ms: int) -> list[Any]:
    """What enqueue_batch takes after its first five arguments: the index's shape, cap and life."""
    return [len(STATUSES), history_max, ttl_ms, *STATUSES]


def status_move_args(task_id: str, status: str, enqueued_ms: str, ttl_s: int, trim: Sequence[int]) -> list[Any]:
    """The ARGV of history_move: a task filed under `status` (scored `enqueued_ms` if the index lacks it)."""
    # `trim`: the index's cap and age limit (ms) it is trimmed to as the task enters it (0, 0: not trimmed).
    return [task_id, status, enqueued_ms, ttl_s * 1000, *trim, *STATUSES]


def bucket_of(duration_ms: float) -> int:
    """The index of the duration bucket `duration_ms` falls in."""
    return bisect.bisect_left(DURATION_BUCKETS_MS, duration_ms)


def counter_fields(update: ResultUpdate) -> list[str]:
    """The fields of its queue's minute hash that a result write adds 1 to: a success, a final failure or a retry."""
    status = update.fields.get("status", "")
    outcome = {records.SUCCESSFUL: "ok", records.FAILED: "failed"}.get(status)
    if status == records.READY and "run_after_ms" in update.fields and update.run_s is not None:
        outcome = "retried"
    if not update.queue or outcome is None:
        return []
    fields = [outcome, f"{outcome}|{update.task_type}"]
    if update.run_s is not None:
        fields.append(f"d|{update.task_type}|{bucket_of(update.run_s * 1000)}")
    return fields


def replies_at(sent: Sequence[Any], places: Sequence[Place]) -> list[Any]:
    """Each result write's reply (1, 0, 2 or its whole call's error), by its call's place and its index in the call."""
    return [sent[at] if isinstance(sent[at], Exception) else sent[at][offset] for at, offset in places]


class Records(Role):
    """Writing result records (each filed in the history and counted in the charts) and reading them back."""

    def __init__(
        self,
        redis: ScriptClient,
        cluster_wait_ms: int = CLUSTER_WAIT_MS,
        history_max: int = HISTORY_MAX,
        history_ttl_s: int = INDEX_TTL_S,
    ) -> None:
        super().__init__(redis)
        self.cluster_wait_ms = cluster_wait_ms
        # A queue's index is trimmed to these as tasks enter it (at their first write).
        self.history_max = history_max
        self.history_ttl_s = history_ttl_s
        # Redis Cluster: per master, whether it had a replica and when that was read.
        self._replica_checks: dict[str, tuple[bool, float]] = {}
        self._masters_pool: ThreadPoolExecutor | None = None
        self._masters_with_scripts: set[str] = set()

    def record_result(self, update: ResultUpdate) -> int:
        """Write one result update: 1 written, 0 ignored (a later run owns it), 2 refused, 4 written again."""
        pipe = self.client.pipeline(transaction=False)
        _, (written,) = self.execute_with_writes(pipe, [update], self.queue_writes(pipe, [update]))
        if isinstance(written, Exception):
            raise written
        return int(written)

    def get_result(self, task_id: str) -> dict[str, str] | None:
        """Return a task's result record as text fields (defaults filled in), or None if there is none."""
        return self.get_results([task_id])[0]

    def get_results(self, task_ids: Iterable[str], fields: Sequence[str] | None = None) -> list[dict[str, str] | None]:
        """The result records of several tasks (only `fields`, if given) in one round trip, as `get_result`."""
        # A task without a record that waits has a mark: it answers READY with its queue and type.
        ids = list(task_ids)
        # An id with a lone surrogate cannot be a key: it names no task.
        storable = [task_id for task_id in ids if is_utf8_encodable(task_id)]
        pipe = self.client.pipeline(transaction=False)
        for task_id in storable:
            pipe.hmget(self.keys.result(task_id), fields) if fields else pipe.hgetall(self.keys.result(task_id))
            pipe.hget(*self.keys.waiting_mark(task_id))
        replies = pipe.execute(raise_on_error=False) if storable else []  # a producer's record of another type: none
        records, marks = replies[0::2], replies[1::2]
        if fields:  # HMGET's reply as HGETALL's: the fields the record has, by name
            records = [
                r
                if isinstance(r, Exception)
                else {f.encode(): v for f, v in zip(fields, r, strict=True) if v is not None}
                for r in records
            ]
        for at, mark in enumerate(marks):
            if not records[at] and isinstance(mark, bytes):
                queue, task_type = split_waiting_mark(mark)
                records[at] = {b"status": b"READY", b"queue": queue.encode(), b"type": task_type.encode()}
        found = dict(zip(storable, records, strict=True))
        return [record_text_fields(task_id, found[task_id]) if task_id in found else None for task_id in ids]

    def delete_finished(self, tasks: Sequence[tuple[str, str]]) -> list[int]:
        """Delete finished tasks' records and history entries, per (queue, id): DELETED, GONE or KEPT."""
        if not tasks:
            return []
        keys = [self.keys.result(task_id) for _, task_id in tasks]
        replies = self.redis.run_on_records("delete_finished", keys, [], [])
        pipe = self.client.pipeline(transaction=False)
        for (queue, task_id), reply in zip(tasks, replies, strict=True):
            for key in index_keys(self.keys, queue) if reply in (DELETED, GONE) else ():
                pipe.zrem(key, task_id)
        pipe.execute()
        return replies

    def history_window(
        self,
        queues: Sequence[str],
        status: str | None,
        max_ms: float | None,
        min_ms: float | None,
        limit: int,
        seen: int = 0,
        after: str = "",
    ) -> list[Entry]:
        """The newest `limit` entries of `queues` (of one status if given), scores in [min_ms, max_ms)."""
        # With `seen`, a page resumes inside ties scored max_ms, skipping the first `seen` (from id `after` on).
        upper = "+inf" if max_ms is None else repr(max_ms) if seen else f"({max_ms!r}"
        lower = repr(min_ms) if min_ms is not None else "-inf"
        keys = [self._index_key(queue, status) for queue in queues]
        windows = self.redis.each(
            keys, lambda pipe, key: pipe.zrevrangebyscore(key, upper, lower, start=0, num=limit + seen, withscores=True)
        )
        rows = [
            (float(score), member, queue)
            for queue, replies in zip(queues, windows, strict=True)
            for member, score in replies
        ]
        rows.sort(reverse=True)
        ties = [member.decode(errors="backslashreplace") for score, member, _ in rows[:seen] if score == max_ms]
        shown = sum(1 for task_id in ties if not after or task_id >= after)
        return [
            Entry(queue, member.decode(errors="backslashreplace"), score)
            for score, member, queue in rows[shown : shown + limit]
        ]

    def history_count(self, queues: Sequence[str], status: str | None, min_ms: float | None) -> int:
        """How many entries of `queues` (of one status if given) are at least as new as `min_ms` (O(log n))."""
        lower = repr(min_ms) if min_ms is not None else "-inf"
        keys = [self._index_key(queue, status) for queue in queues]
        return sum(self.redis.each(keys, lambda pipe, key: pipe.zcount(key, lower, "+inf")))

    def history_by_prefix(self, queues: Sequence[str], prefix: str, limit: int) -> list[Entry]:
        """Up to `limit` tasks of `queues` whose id starts with `prefix` (lexical range, O(log n))."""
        # The byte FF, not the text "\xff" (sent as UTF-8 C3 BF, below the bytes of "€" or any emoji).
        lower = f"[{prefix}".encode()
        keys = [self.keys.history_ids(queue) for queue in queues]
        matches = self.redis.each(
            keys, lambda pipe, key: pipe.zrangebylex(key, lower, lower + b"\xff", start=0, num=limit)
        )
        found = {
            queue: [member.decode(errors="backslashreplace") for member in members]
            for queue, members in zip(queues, matches, strict=True)
            if members
        }
        scores = self.redis.each(found, lambda pipe, queue: pipe.zmscore(self.keys.history(queue), found[queue]))
        scored = [
            Entry(queue, task_id, float(score or 0))
            for queue, of_queue in zip(found, scores, strict=True)
            for task_id, score in zip(found[queue], of_queue, strict=True)
        ]
        return sorted(scored, key=lambda entry: entry.score_ms, reverse=True)[:limit]

    def _index_key(self, queue: str, status: str | None) -> str:
        return self.keys.history_status(queue, status) if status else self.keys.history(queue)

    def refresh_history_ttl(self, queue: str, ttl_s: int) -> None:
        """Give `queue`'s index keys the result time to live again (a status index made by a result write has none)."""
        self.redis.each(index_keys(self.keys, queue), lambda pipe, key: pipe.pexpire(key, ttl_s * 1000))

    def queue_writes(
        self, pipe: Any, updates: Sequence[ResultUpdate], *, by_source: bool = False, instance: str | None = None
    ) -> list[Place]:
        """Queue the record_result calls of `updates`; return their replies' places."""
        # Given the settling consumer's `instance` (one server), a `held_by` write is made only while it holds the task.
        places: list[Place] = [(0, 0)] * len(updates)
        for queue, indexes in self._result_groups(updates):
            for start in range(0, len(indexes), RECORDS_PER_CALL):
                chunk = indexes[start : start + RECORDS_PER_CALL]
                for offset, index in enumerate(chunk):
                    places[index] = (len(pipe), offset)
                self._queue_record_call(pipe, queue, [updates[index] for index in chunk], by_source, instance)
        return places

    def execute_with_writes(
        self, pipe: Any, updates: Sequence[ResultUpdate], places: Sequence[Place], earlier: Sequence[Any] = ()
    ) -> tuple[list[Any], list[Any]]:
        """Execute `pipe` with the Redis Cluster side writes of `updates` (`earlier`: all their replies, if written)."""
        cluster = isinstance(self.client, redis.RedisCluster)
        minute = int(time.time()) // 60
        if cluster:
            self._queue_cluster_side_writes(pipe, updates, earlier, minute)
        sent = self.scripts.execute(pipe, self.client, raise_on_error=False)
        written = [*earlier, *replies_at(sent, places)]
        if cluster and not earlier:
            self._uncount_unwritten(updates, written, minute)
        return sent, written

    def write_on_masters(self, results: Sequence[ResultUpdate]) -> tuple[list[Any], int]:
        """Write results on a cluster, every master at once; return each write's reply and how many WAITs timed out."""
        by_master: dict[str, list[int]] = {}
        nodes: dict[str, Any] = {}
        for index, update in enumerate(results):
            node = self.client.get_node_from_key(self.keys.result(update.task_id))
            nodes[node.name] = node
            by_master.setdefault(node.name, []).append(index)
        jobs = [(nodes[name], [results[index] for index in indexes]) for name, indexes in by_master.items()]
        if len(jobs) == 1:
            done = [self._write_on_master(*jobs[0])]
        else:
            if self._masters_pool is None:
                self._masters_pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="results-on-masters")
            futures = [self._masters_pool.submit(self._write_on_master, *job) for job in jobs]
            wait_for(futures)  # every master has answered before an error of one is raised
            done = [future.result() for future in futures]
        written: list[Any] = [None] * len(results)
        for indexes, (replies, _) in zip(by_master.values(), done, strict=True):
            for index, reply in zip(indexes, replies, strict=True):
                written[index] = reply
        return written, sum(timed_out for _, timed_out in done)

    def _write_on_master(self, node: Any, updates: list[ResultUpdate]) -> tuple[list[Any], int]:
        """Write `updates` on `node` and WAIT there for a replica; return the replies and 1 if the WAIT timed out."""
        # WAIT counts its own connection's writes: it goes in their pipeline. A lost node, a moved slot
        # or a failed WAIT raise ClusterError, so the caller writes the results again on the new master.
        client = self.client.get_redis_connection(node)
        waits = self._has_replica(node.name, client)
        replies: list[Any] = [None] * len(updates)
        todo = list(range(len(updates)))
        timed_out = 0
        # By source first on a master not yet written to here, so a WAIT is not spent on NOSCRIPT.
        for by_source in (False, True) if node.name in self._masters_with_scripts else (True,):
            pipe = client.pipeline(transaction=False)
            places = self.queue_writes(pipe, [updates[index] for index in todo], by_source=by_source)
            if waits:
                pipe.execute_command("WAIT", 1, self.cluster_wait_ms)
            sent = self._execute_on_master(node, pipe, waits)
            timed_out = 1 if waits and int(sent[-1]) < 1 else timed_out
            for index, reply in zip(todo, replies_at(sent, places), strict=True):
                replies[index] = reply
            todo = [index for index in todo if isinstance(replies[index], NoScriptError)]
            if not todo:
                self._masters_with_scripts.add(node.name)
                break
        return replies, timed_out

    def _execute_on_master(self, node: Any, pipe: Any, waits: bool) -> list[Any]:
        """Execute a pipeline on one master; ClusterError (after reading the slot map again) if the node failed it."""
        try:
            sent = pipe.execute(raise_on_error=False)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            self.client.nodes_manager.initialize()
            raise ClusterError(f"lost master {node.name} while writing results: {exc}") from exc
        if any(isinstance(reply, _NODE_STATE_REPLIES) for reply in sent) or (waits and isinstance(sent[-1], Exception)):
            self.client.nodes_manager.initialize()
            raise ClusterError(f"master {node.name} answered as in a failover: {sent}")
        return list(sent)

    def _has_replica(self, name: str, client: Any) -> bool:
        """Whether master `name` has a connected replica (read again every REPLICA_CHECK_S)."""
        checked = self._replica_checks.get(name)
        now_s = time.monotonic()
        if checked is None or now_s - checked[1] > REPLICA_CHECK_S:
            checked = (int(client.info("replication").get("connected_slaves", 0)) > 0, now_s)
            self._replica_checks[name] = checked
        return checked[0]

    def _result_groups(self, updates: Sequence[ResultUpdate]) -> list[tuple[str, list[int]]]:
        """The updates' indexes by the queue whose history their call files them in ("": none)."""
        if isinstance(self.client, redis.RedisCluster):
            return [("", [index]) for index in range(len(updates))]
        groups: dict[str, list[int]] = {}
        for index, update in enumerate(updates):
            groups.setdefault(update.queue, []).append(index)
        return list(groups.items())

    def _queue_record_call(
        self, pipe: Any, queue: str, updates: Sequence[ResultUpdate], by_source: bool, instance: str | None
    ) -> None:
        """Queue one record_result call; given a queue (one server), it files and counts the writes it takes."""
        keys: list[str] = []
        args: list[Any] = [0]
        if queue:
            keys = [*index_keys(self.keys, queue), self.keys.minute(queue, int(time.time()) // 60)]
            args = [len(STATUSES), *STATUSES, KEEP_MINUTES * 60, *self._trim_args()]
        lists = {} if instance is None else {u.held_by[0]: 0 for u in updates if u.held_by is not None}
        args.append(len(lists))
        for number, (held_queue, consumer_id) in enumerate(lists, start=1):
            lists[held_queue, consumer_id] = number
            keys += self.keys.queue_keys(held_queue, "processing consumer_info consumers", consumer_id)
            args += (consumer_id, instance)
        for update in updates:
            if lists:
                args += (0, "") if update.held_by is None else (lists[update.held_by[0]], update.held_by[1])
            keys.append(self.keys.result(update.task_id))
            args += (
                update.ttl_s,
                update.append_worker_id or "",
                json.dumps(update.append_error) if update.append_error else "",
                update.fence or "",
                update.task_id,
            )
            if queue:
                counted = counter_fields(update)
                args += (len(counted), *counted)
            args.append(len(update.fields))
            for name, value in update.fields.items():
                args += (name, value)
        self.scripts.queue(pipe, "record_result", keys, args, by_source=by_source)

    def _queue_cluster_side_writes(
        self, pipe: Any, updates: Sequence[ResultUpdate], earlier: Sequence[Any], minute: int
    ) -> None:
        """Queue the history moves and chart counts a Redis Cluster record write cannot do (another slot)."""
        # Given the writes' replies (`earlier`), those the records took; else all, uncounted after if not taken.
        moved = updates
        if earlier:
            moved = [update for update, reply in zip(updates, earlier, strict=True) if reply in (1, WRITTEN_AGAIN)]
            updates = [update for update, reply in zip(updates, earlier, strict=True) if reply == 1]
        for update in moved:
            if update.queue and "status" in update.fields:  # it changes where its task is filed
                keys = index_keys(self.keys, update.queue)
                enqueued_ms = update.fields.get("enqueued_at_ms", "")
                args = status_move_args(
                    update.task_id, update.fields["status"], enqueued_ms, update.ttl_s, self._trim_args()
                )
                self.scripts.queue(pipe, "history_move", keys, args)
        self._queue_minute_counts(pipe, updates, minute)

    def _trim_args(self) -> list[int]:
        return [self.history_max, self.history_ttl_s * 1000]

    def _queue_minute_counts(self, pipe: Any, updates: Sequence[ResultUpdate], minute: int, sign: int = 1) -> None:
        """Add (`sign` -1: take back) the counters of `updates` to `minute`'s hashes, last in a pipeline."""
        counts: dict[str, Counter[str]] = {}
        for update in updates:
            if counted := counter_fields(update):
                counts.setdefault(update.queue, Counter()).update(counted)
        for queue, fields in counts.items():
            key = self.keys.minute(queue, minute)
            for name, amount in fields.items():
                pipe.hincrby(key, name, sign * amount)
            pipe.expire(key, KEEP_MINUTES * 60)

    def _uncount_unwritten(self, updates: Sequence[ResultUpdate], replies: Sequence[Any], minute: int) -> None:
        """Take back the counts of result writes the record did not take (ignored by their fence, or refused)."""
        unwritten = [update for update, reply in zip(updates, replies, strict=True) if reply != 1]
        if any(counter_fields(update) for update in unwritten):
            pipe = self.client.pipeline(transaction=False)
            self._queue_minute_counts(pipe, unwritten, minute, sign=-1)
            pipe.execute()


# Cancel requests of running tasks are kept this long.
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


@dataclass(frozen=True)
class CancelReply:
    """What a cancel did to one task."""

    task_id: str
    outcome: str  # CANCELLED, REQUESTED, FINISHED or UNKNOWN
    queue: str
    status: str  # the record's status after the cancel ("" if unknown)
    at_ms: int  # server time of the cancel (of the first request, for a running task)


class Control(Role):
    """Cancels and cancel requests (one round trip each, two for a running task's), pausing queues."""

    def cancel_many(self, task_ids: Sequence[str], cancelled_by: str = "", force: bool = False) -> list[CancelReply]:
        """Cancel tasks by id in a round trip (+1 if some run, +1 on Cluster; `force`: by their consumer)."""
        answers = self.redis.run_many("cancel", self._cancel_calls(task_ids, cancelled_by))
        cluster = isinstance(self.client, redis.RedisCluster)
        replies = [
            CancelReply(task_id, reply_text(outcome), reply_text(queue), reply_text(status), int(at_ms))
            for task_id, (outcome, queue, status, at_ms, *_) in zip(task_ids, answers, strict=True)
        ]
        pipe = self.client.pipeline(transaction=False)
        for reply, answer in zip(replies, answers, strict=True):
            # A foreign record's queue name ("", "}x") may spread its keys over a cluster's slots: not told.
            if NAME_PATTERN.fullmatch(reply.queue) is None:
                continue
            if reply.outcome == CANCELLED:  # the task browser's history: READY to CANCELLED (another slot)
                if cluster:  # its mark, if it had one (a lost delete is harmless: the record is read first)
                    pipe.hdel(*self.keys.waiting_mark(reply.task_id))
                args = status_move_args(reply.task_id, records.CANCELLED, "", INDEX_TTL_S, (0, 0))
                self.scripts.queue(pipe, "history_move", index_keys(self.keys, reply.queue), args)
                if len(answer) > 4 and answer[4]:  # a key its end frees (unique_until = finished): it never runs
                    keys = [self.keys.unique(reply.queue, reply_text(answer[4]))]
                    self.scripts.queue(pipe, "release_unique", keys, [reply.task_id])
            elif reply.outcome == REQUESTED:  # tell its consumer (and trim old requests)
                forced = [self.keys.cancel_forced(reply.queue)] if force else []
                for key in [self.keys.cancel_requests(reply.queue), *forced]:
                    pipe.zadd(key, {reply.task_id: reply.at_ms})
                    pipe.zremrangebyscore(key, "-inf", f"({reply.at_ms - CANCEL_REQUESTS_KEEP_MS}")
        if len(pipe):
            self.scripts.execute(pipe, self.client)
        return replies

    def _cancel_calls(self, task_ids: Sequence[str], cancelled_by: str) -> list[tuple[list[str], list[Any]]]:
        """The cancel calls: the mark read inside (one server) or first, its queue and type passed (Redis Cluster)."""
        marks = [self.keys.waiting_mark(task_id) for task_id in task_ids]
        if not isinstance(self.client, redis.RedisCluster):
            return [
                ([self.keys.result(task_id), bucket], [cancelled_by, INDEX_TTL_S, mark])
                for task_id, (bucket, mark) in zip(task_ids, marks, strict=True)
            ]
        named = self.redis.each(marks, lambda pipe, mark: pipe.hget(*mark))
        return [
            ([self.keys.result(task_id)], [cancelled_by, INDEX_TTL_S, *split_waiting_mark(value or b" ")])
            for task_id, value in zip(task_ids, named, strict=True)
        ]

    def cancel_marks(self, queue: str, task_ids: Sequence[str]) -> list[CancelMark]:
        """What was asked of each of these (running) tasks of `queue`: two ZMSCOREs in one round trip."""
        if not task_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        pipe.zmscore(self.keys.cancel_requests(queue), list(task_ids))
        pipe.zmscore(self.keys.cancel_forced(queue), list(task_ids))
        requested, forced = pipe.execute()
        pairs = zip(requested, forced, strict=True)
        return [CancelMark(2 if by_force is not None else int(asked is not None)) for asked, by_force in pairs]

    def release_unique(self, queue: str, digest: str, task_id: str, after_ms: int = 0) -> bool:
        """Free a uniqueness key if task `task_id` holds it (in `after_ms`, if its window ends later); True if so."""
        return bool(self.redis.run("release_unique", [self.keys.unique(queue, digest)], [task_id, after_ms]))

    def pause(self, queue: str, by: str = "") -> bool:
        """Pause `queue` (kept in Redis, so it survives consumer restarts); False if it already was."""
        state = json.dumps({"since_ms": self.redis.server_time_us() // 1000, "by": by})
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.keys.paused(queue), state, nx=True)
        self.redis.announce(pipe, [queue])
        created, _ = self.scripts.execute(pipe, self.client)
        return bool(created)

    def resume(self, queue: str) -> bool:
        """Resume `queue`; False if it was not paused. Claimers see it at their next pause re-check."""
        return bool(self.client.delete(self.keys.paused(queue)))

    def is_paused(self, queue: str) -> bool:
        """True while `queue` is paused."""
        return bool(self.client.exists(self.keys.paused(queue)))

    def pause_states(self, queues: Sequence[str]) -> dict[str, dict[str, Any] | None]:
        """Per queue, its pause state ({"since_ms", "by"}, as `pause` wrote it) or None when it runs."""
        replies = self.redis.each(queues, lambda pipe, queue: pipe.get(self.keys.paused(queue)))
        return {queue: None if raw is None else json.loads(raw) for queue, raw in zip(queues, replies, strict=True)}
