"""Producing: `Enqueuer` pushes tasks with their waiting marks or READY records, and announces their queues.

A task with an id the producer generated gets a waiting mark (`waiting_mark`); a unique task or one whose id
the caller chose (django.tasks' result ids, a caller's retry key) gets a READY record. On a single Redis
server an enqueue is all or nothing. On Redis Cluster marks and records lie in other slots than their queue:
the caller's ids are claimed on their records first (docs/PROTOCOL.md, "Enqueue atomicity").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

import redis

from tasks_app.protocol import history
from tasks_app.protocol.keys import WAKE_TOKEN, Keys, waiting_mark_value
from tasks_app.protocol.scripts import Role, ScriptClient, reply_text

# How long a producer trusts its last SADD of a queue (the set may be deleted behind it).
ANNOUNCE_AGAIN_S = 60.0
# Caller's ids remembered per queue, so a retry after a lost reply does not push them twice.
ENQUEUED_IDS_KEEP_MS = 24 * 3600 * 1000
ENQUEUED_IDS_MAX = 100_000


class Enqueueable(NamedTuple):
    """A serialized task ready to push: where, when (from Redis's now), and its READY record's fields."""

    queue: str
    raw: bytes
    priority: int = 0
    delay_ms: int = 0
    result_key_fields: Mapping[str, str] = MappingProxyType({})  # a NamedTuple: built per task, fast
    task_id: str = ""
    # The caller chose the id: a task with this id enqueued to this queue recently is not pushed again.
    idempotent: bool = False
    # A waiting mark (queue and type) instead of the READY record of `result_key_fields`.
    waiting_mark: bool = False


class UniqueEnqueueable(NamedTuple):
    """A task to push only if no task of its type and uniqueness key was enqueued within its window."""

    item: Enqueueable
    digest: str  # names the uniqueness key P:{queue}:unique:<digest>
    window_ms: int


class IdClaims(NamedTuple):
    """What claiming a call's caller ids on their records found."""

    written: dict[str, bool]  # per id claimed: whether its record was written (else a run or cancel touched it)
    taken: set[str]  # ids whose record names another queue: nothing is pushed under them
    refused: dict[str, Exception]  # ids whose claim Redis refused, with its error: nothing pushed either


class AnnouncedQueues:
    """The queues added to the queue set within the last `again_s` seconds (by this process's clock)."""

    __slots__ = ("_added_at", "_again_s", "_clock")

    def __init__(self, again_s: float = ANNOUNCE_AGAIN_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._added_at: dict[str, float] = {}
        self._again_s = again_s
        self._clock = clock

    def __contains__(self, queue: object) -> bool:
        added_at = self._added_at.get(queue) if isinstance(queue, str) else None
        return added_at is not None and self._clock() - added_at < self._again_s

    def add(self, queues: Iterable[str]) -> None:
        """Remember `queues` as added to the set now."""
        now = self._clock()
        for queue in queues:
            self._added_at[queue] = now


@dataclass
class Section:
    """One queue's tasks: plain ones, the others as (id, priority, delay ms, task), those with a READY record."""

    plain: list[bytes] = field(default_factory=list)
    others: list[Any] = field(default_factory=list)
    recorded: list[Enqueueable] = field(default_factory=list)
    others_at: list[int] = field(default_factory=list)  # the batch positions of `others`, as the script names them

    def args(self, queue: str, with_plain: bool = True) -> list[Any]:
        """The section's ARGV: queue name, plain tasks (if `with_plain`, else none), the others, the record ids."""
        plain = self.plain if with_plain else []
        recorded = [item.task_id for item in self.recorded]
        return [queue, len(plain), *plain, len(self.others) // 4, *self.others, len(recorded), *recorded]


def split_by_queue(items: Sequence[Enqueueable]) -> dict[str, Section]:
    """Split tasks into one section per queue, keeping their order."""
    by_queue: dict[str, Section] = {}
    for position, item in enumerate(items):
        section = by_queue.get(item.queue) or by_queue.setdefault(item.queue, Section())
        if item.priority or item.delay_ms > 0 or item.idempotent:  # else plain: priority 0, due now, no id to check
            section.others += (item.task_id if item.idempotent else "", item.priority, item.delay_ms, item.raw)
            section.others_at.append(position)
        else:
            section.plain.append(item.raw)
        if item.result_key_fields and not item.waiting_mark:
            section.recorded.append(item)
    return by_queue


def waiting_marks(keys: Keys, items: Iterable[Enqueueable]) -> list[tuple[str, bytes, str]]:
    """The waiting marks of the tasks that have one: bucket hash, field and value."""
    return [
        (*keys.waiting_mark(item.task_id), waiting_mark_value(item.queue, item.result_key_fields["type"]))
        for item in items
        if item.waiting_mark and item.result_key_fields
    ]


def id_claims(items: Sequence[Enqueueable], uniques: Sequence[Enqueueable]) -> tuple[list[Enqueueable], set[str]]:
    """Redis Cluster: per caller's id, the READY record claiming it before any push; and the ids written whole later."""
    # An id given only to several unique tasks is claimed by a record naming its queue alone.
    claims: dict[str, Enqueueable] = {}
    for item in items:
        if item.idempotent and item.result_key_fields:
            claims.setdefault(item.task_id, item)
    of_items, repeated = set(claims), set()
    for item in uniques:
        if not (item.idempotent and item.result_key_fields) or item.task_id in of_items:
            continue
        if item.task_id in claims:
            item = item._replace(result_key_fields={"queue": item.queue})
            repeated.add(item.task_id)
        claims[item.task_id] = item
    return list(claims.values()), repeated


def record_groups(items: Sequence[Enqueueable], result_ttl_s: int) -> list[Any]:
    """READY records as groups (count, ttl s, pairs...); a record outlives its task's due time by result_ttl_s."""
    args: list[Any] = []
    shared: Mapping[str, str] | None = None
    count_at = 0
    for item in items:
        if not item.result_key_fields:
            continue
        if item.result_key_fields is shared:  # the producer shares one dict between identical tasks
            args[count_at] += 1
            continue
        shared, count_at = item.result_key_fields, len(args)
        args += (1, result_ttl_s + math.ceil(max(0, item.delay_ms) / 1000), len(shared))
        for name, value in shared.items():
            args += (name, value)
    return args


def record_only_args(item: Enqueueable, result_ttl_s: int) -> list[Any]:
    """The ARGV of an enqueue_batch call that writes `item`'s READY record alone (its own slot on Redis Cluster)."""
    return ["", 0, 1, "0", 0, *record_groups([item], result_ttl_s)]


class Enqueuer(Role):
    """Enqueueing: one call or MULTI/EXEC on one server; on Redis Cluster one call per queue and per record."""

    def __init__(self, redis: ScriptClient, announced: AnnouncedQueues, history_max: int) -> None:
        super().__init__(redis)
        self.announced = announced  # one SADD per queue a minute, not per enqueue
        self.history_max = history_max

    def enqueue(
        self, items: Sequence[Enqueueable], result_ttl_s: int, uniques: Sequence[UniqueEnqueueable] = ()
    ) -> list[str | None]:
        """Push the tasks and `uniques` with their marks or records: per task None (pushed) or the id in its place."""
        # On Redis Cluster some may be pushed when an error is raised.
        if not uniques and len(items) == 1 and self._enqueue_one(items[0], result_ttl_s):
            return [None]
        claimed, whole_later = IdClaims({}, set(), {}), set[str]()
        if isinstance(self.client, redis.RedisCluster):
            # A claim Redis refuses keeps its id's tasks back; the others are pushed, then it is raised.
            claims, whole_later = id_claims(items, [unique.item for unique in uniques])
            claimed = self._claim_ids(claims, result_ttl_s) if claims else claimed
        blocked = claimed.taken | claimed.refused.keys()
        outcomes = [item.task_id if item.idempotent and item.task_id in blocked else None for item in items]
        holders = [item.task_id if item.idempotent and item.task_id in blocked else None for item, *_ in uniques]
        recorded = self._push(items, uniques, result_ttl_s, outcomes, holders, claimed)
        self._settle_unique_records(uniques, holders, recorded, whole_later, result_ttl_s)
        if claimed.refused:
            raise next(iter(claimed.refused.values()))
        return [*outcomes, *holders]

    def _enqueue_one(self, item: Enqueueable, result_ttl_s: int) -> bool:
        # The common single enqueue as one script call (~15 % more tasks/s than a pipeline of two
        # commands); not on Redis Cluster (its keys lie in different slots). False: nothing written.
        if item.priority or item.delay_ms > 0 or item.idempotent or not item.result_key_fields:
            return False
        if item.queue not in self.announced or isinstance(self.client, redis.RedisCluster):
            return False
        if item.waiting_mark:
            [(key, mark, value)] = waiting_marks(self.keys, [item])
            args = [item.raw, 0, mark, value]
        else:
            key, args = self.keys.result(item.task_id), [item.raw, result_ttl_s]
            for name, value in item.result_key_fields.items():
                args += (name, value)
        self.redis.run("enqueue_one", [self.keys.pending(item.queue), key], args, direct=True)
        return True

    def _claim_ids(self, claims: Sequence[Enqueueable], result_ttl_s: int) -> IdClaims:
        """Write the records claiming caller's ids (unless a run or cancel touched them) in one round trip."""
        calls = [([self.keys.result(item.task_id)], record_only_args(item, result_ttl_s)) for item in claims]
        claimed = IdClaims({}, set(), {})
        for item, reply in zip(claims, self.redis.run_many("enqueue_batch", calls, False), strict=True):
            if isinstance(reply, Exception):
                claimed.refused[item.task_id] = reply
            elif len(reply) > 2:
                claimed.taken.add(item.task_id)
            else:
                claimed.written[item.task_id] = bool(int(reply[1]))
        return claimed

    def _push(
        self,
        items: Sequence[Enqueueable],
        uniques: Sequence[UniqueEnqueueable],
        result_ttl_s: int,
        outcomes: list[str | None],
        holders: list[str | None],
        claimed: IdClaims,
    ) -> list[bool]:
        """Push the tasks whose `outcomes` and `holders` are None, filling them in; per unique task: record written?"""
        # One enqueue_batch call per queue. One server: plain tasks as native commands, the waiting marks in one
        # mark_waiting call, and several calls in MULTI/EXEC (refused whole when out of memory), the first of each
        # script by source so NOSCRIPT cannot split them. Redis Cluster: marks (one HSET each) before the pushes,
        # each record in a call of its own (its own slot), beside or before its push.
        cluster = isinstance(self.client, redis.RedisCluster)
        free = [at for at, outcome in enumerate(outcomes) if outcome is None]
        free_uniques = [at for at, holder in enumerate(holders) if holder is None]
        free_items = [items[at] for at in free]
        sections = split_by_queue(free_items)
        marks = waiting_marks(self.keys, free_items)
        new_queues = {
            q for q in [*sections, *(uniques[at].item.queue for at in free_uniques)] if q not in self.announced
        }
        several = len(sections) > 1 or free_uniques or new_queues or marks or any(s.plain for s in sections.values())
        multi = not cluster and bool(several)
        pipe = self.client.pipeline(transaction=multi)
        head = [WAKE_TOKEN, ENQUEUED_IDS_KEEP_MS, ENQUEUED_IDS_MAX, "0", 1]
        batches: list[tuple[int, list[int]]] = []  # per call: its place, its tasks' positions
        for bucket, mark, value in marks if cluster else ():  # before the pushes: a receipt deletes a mark
            pipe.hset(bucket, mark, value)
        for item in items if cluster else ():
            if item.result_key_fields and not (item.idempotent or item.waiting_mark):  # its record beside its push
                self._queue_record(pipe, item, result_ttl_s)
        for queue, section in sections.items():
            records = [] if cluster else section.recorded
            if section.plain and not cluster:
                pipe.lpush(self.keys.pending(queue), *section.plain)
            keys = [*self._section_keys(queue), *(self.keys.result(item.task_id) for item in records)]
            args = [*head, *section.args(queue, with_plain=cluster), *record_groups(records, result_ttl_s)]
            self.scripts.queue(pipe, "enqueue_batch", keys, args, by_source=multi and not batches)
            batches.append((len(pipe) - 1, section.others_at))
        recorded_ids = claimed.written.keys() | claimed.taken
        calls = self._queue_uniques(pipe, [uniques[at] for at in free_uniques], result_ttl_s, multi, recorded_ids)
        if marks and not cluster:
            pairs = [part for _, mark, value in marks for part in (mark, value)]
            self.scripts.queue(pipe, "mark_waiting", [bucket for bucket, _, _ in marks], pairs, by_source=True)
        if new_queues:
            self.redis.announce(pipe, new_queues, by_source=multi)
        replies = self.scripts.execute(pipe, self.client)
        self.announced.add(new_queues)
        for at, others_at in batches:  # the reply numbers (from 1) the tasks of `others_at` it did not push
            for position in (free[others_at[int(number) - 1]] for number in replies[at][2:]):
                outcomes[position] = items[position].task_id
        recorded = [claimed.written.get(unique.item.task_id, False) for unique in uniques]
        for at, (script_at, record_at) in zip(free_uniques, calls, strict=True):
            holders[at] = None if int(replies[script_at][0]) else reply_text(replies[script_at][1])
            recorded[at] = recorded[at] or (record_at >= 0 and bool(int(replies[record_at][1])))
        return recorded

    def _section_keys(self, queue: str) -> list[str]:
        return self.keys.queue_keys(queue, "pending prioritized delayed enqueued")

    def _settle_unique_records(
        self,
        uniques: Sequence[UniqueEnqueueable],
        holders: Sequence[str | None],
        recorded: Sequence[bool],
        whole_later: set[str],
        result_ttl_s: int,
    ) -> None:
        """Redis Cluster: delete the records written for unique tasks not pushed; write whole those naming a queue."""
        pairs = list(zip(uniques, holders, strict=True))
        kept = {unique.item.task_id for unique, holder in pairs if holder in (None, unique.item.task_id)}
        doomed = {unique.item.task_id for unique, wrote in zip(uniques, recorded, strict=True) if wrote} - kept
        whole = [unique.item for unique, holder in pairs if holder is None and unique.item.task_id in whole_later]
        if not (doomed or whole):
            return
        pipe = self.client.pipeline(transaction=False)
        for task_id in doomed:
            pipe.delete(self.keys.result(task_id))
        for item in whole:
            self._queue_record(pipe, item, result_ttl_s)
        self.scripts.execute(pipe, self.client)

    def _queue_uniques(
        self, pipe: Any, uniques: Sequence[UniqueEnqueueable], result_ttl_s: int, multi: bool, recorded: Set[str]
    ) -> list[tuple[int, int]]:
        """Queue the `enqueue_unique` calls (the first by source in a MULTI): per task its place, its record's (-1)."""
        cluster = isinstance(self.client, redis.RedisCluster)
        index = history.header_args(self.history_max, result_ttl_s * 1000)
        calls: list[tuple[int, int]] = []
        recorded = set(recorded)
        for position, unique in enumerate(uniques):
            item = unique.item
            keys = [self.keys.unique(item.queue, unique.digest), *self._section_keys(item.queue)]
            keys += history.index_keys(self.keys, item.queue)  # a unique task is filed READY as it is pushed
            record: list[str] = []
            record_at = -1
            if not cluster:
                record = [pair for field in item.result_key_fields.items() for pair in field]
                keys += [self.keys.result(item.task_id)] if record else []
            elif item.result_key_fields and item.task_id not in recorded:
                recorded.add(item.task_id)
                self._queue_record(pipe, item, result_ttl_s)
                record_at = len(pipe) - 1
            args = [item.task_id, unique.window_ms, WAKE_TOKEN, item.priority, item.delay_ms, item.raw]
            args += [result_ttl_s + item.delay_ms // 1000 + 1, "1" if item.idempotent else "0"]
            args += [ENQUEUED_IDS_KEEP_MS, ENQUEUED_IDS_MAX, *index, *record]
            calls.append((len(pipe), record_at))
            self.scripts.queue(pipe, "enqueue_unique", keys, args, by_source=multi and position == 0)
        return calls

    def _queue_record(self, pipe: Any, item: Enqueueable, result_ttl_s: int) -> None:
        """Queue an enqueue_batch call writing `item`'s READY record alone (in its own slot on Redis Cluster)."""
        self.scripts.queue(
            pipe, "enqueue_batch", [self.keys.result(item.task_id)], record_only_args(item, result_ttl_s)
        )
