"""The history index of each queue: recent task ids by enqueue time, per status, and by id for prefix search.

Per queue, all in its hash tag: ``history`` (id -> enqueue time in server ms, µs in the
fraction), ``history:ids`` (the same ids scored 0: a lexical range finds an id prefix) and one
``history:<STATUS>`` per status of STATUSES. The enqueue scripts add a task, `record_result`
moves it between the status indexes as its record's status changes (on Redis Cluster, where the
record lies in another slot, `history_move` does in the same round trip). Each call of an
enqueue script trims the queue's history to `history_max` tasks and to the result time to live.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import redis
from django.tasks import TaskResultStatus

from tasks_app.protocol.jsontext import is_utf8_encodable
from tasks_app.protocol.keys import Keys
from tasks_app.protocol.replies import ResultUpdate, record_text_fields
from tasks_app.protocol.scripts import ScriptClient

# Every status a record can have (as results.py names them; not imported from there, which would
# make an import cycle through tasks_app.exceptions), each with an index of its own.
CANCELLED = "CANCELLED"
STATUSES: tuple[str, ...] = (*(status.value for status in TaskResultStatus), CANCELLED)

HISTORY_MAX = 100_000
# Time to live given to index keys where the result TTL is not at hand (a cancel); the consumers'
# schedulers set the result TTL again every few seconds.
INDEX_TTL_S = 7 * 24 * 3600
# What delete_finished answers per task: no record, deleted, kept (see lua/delete_finished.lua).
GONE, DELETED, KEPT = 0, 1, 2


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


def indexed(update: ResultUpdate) -> bool:
    """Whether a result write changes where its task is filed (it sets a status, its queue known)."""
    return bool(update.queue) and "status" in update.fields


def move_args(update: ResultUpdate) -> list[Any]:
    """The ARGV of history_move for an update: id, status, fallback score, ttl (ms), status names."""
    return status_move_args(
        update.task_id, update.fields["status"], update.fields.get("enqueued_at_ms", ""), update.ttl_s
    )


def status_move_args(task_id: str, status: str, enqueued_ms: str, ttl_s: int) -> list[Any]:
    """The ARGV of history_move: a task filed under `status` (scored `enqueued_ms` if the index lacks it)."""
    return [task_id, status, enqueued_ms, ttl_s * 1000, *STATUSES]


class HistoryOps(ScriptClient):
    """Reading the history index (pages, prefix search) and deleting tasks from it."""

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
        """The newest `limit` entries of `queues` (of one status if given), scores in [min_ms, max_ms).

        With `seen`, scores in [min_ms, max_ms] but for the first `seen` of those scored max_ms:
        a page resumes inside a run of equal scores (an outside producer's tasks of one
        millisecond), which are ordered by id, as Redis orders them within each key; with `after`
        (the last id shown), those still there from it on, so that ties that left the index (a
        status filter's tasks moving on) leave none of the others unshown.
        """
        upper = "+inf" if max_ms is None else repr(max_ms) if seen else f"({max_ms!r}"
        lower = repr(min_ms) if min_ms is not None else "-inf"
        keys = [self._index_key(queue, status) for queue in queues]
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.zrevrangebyscore(key, upper, lower, start=0, num=limit + seen, withscores=True)
        rows = [
            (float(score), member, queue)
            for queue, replies in zip(queues, pipe.execute(), strict=True)
            for member, score in replies
        ]
        rows.sort(reverse=True)
        shown = _shown_ties(rows[:seen], max_ms, after)
        return [
            Entry(queue, member.decode(errors="backslashreplace"), score)
            for score, member, queue in rows[shown : shown + limit]
        ]

    def history_count(self, queues: Sequence[str], status: str | None, min_ms: float | None) -> int:
        """How many entries of `queues` (of one status if given) are at least as new as `min_ms` (O(log n))."""
        keys = [self._index_key(queue, status) for queue in queues]
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.zcount(key, repr(min_ms) if min_ms is not None else "-inf", "+inf")
        return sum(pipe.execute())

    def history_by_prefix(self, queues: Sequence[str], prefix: str, limit: int) -> list[Entry]:
        """Up to `limit` tasks of `queues` whose id starts with `prefix` (lexical range, O(log n))."""
        lower = f"[{prefix}".encode()
        keys = [self.keys.history_ids(queue) for queue in queues]
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            # The byte FF, not the text "\xff" (sent as UTF-8 C3 BF, below the bytes of "€" or any emoji).
            pipe.zrangebylex(key, lower, lower + b"\xff", start=0, num=limit)
        found = {
            queue: [member.decode(errors="backslashreplace") for member in members]
            for queue, members in zip(queues, pipe.execute(), strict=True)
            if members
        }
        keys = [self.keys.history(queue) for queue in found]
        pipe = self.client.pipeline(transaction=False)
        for key, ids in zip(keys, found.values(), strict=True):
            pipe.zmscore(key, ids)
        scored = [
            Entry(queue, task_id, float(score or 0))
            for queue, scores in zip(found, pipe.execute(), strict=True)
            for task_id, score in zip(found[queue], scores, strict=True)
        ]
        return sorted(scored, key=lambda entry: entry.score_ms, reverse=True)[:limit]

    def _index_key(self, queue: str, status: str | None) -> str:
        return self.keys.history_status(queue, status) if status else self.keys.history(queue)

    def refresh_history_ttl(self, queue: str, ttl_s: int) -> None:
        """Give `queue`'s index keys the result time to live again (a status index made by a result write has none)."""
        pipe = self.client.pipeline(transaction=False)
        for key in index_keys(self.keys, queue):
            pipe.pexpire(key, ttl_s * 1000)
        pipe.execute()

    def get_results(self, task_ids: Iterable[str], fields: Sequence[str] | None = None) -> list[dict[str, str] | None]:
        """The result records of several tasks in one round trip, as `get_result` returns each.

        With `fields`, only those are read (a list leaves out the arguments and return value, megabytes each).
        """
        ids = list(task_ids)
        # An id that is not valid Unicode (a lone surrogate) cannot be a key: it names no task.
        storable = [task_id for task_id in ids if is_utf8_encodable(task_id)]
        pipe = self.client.pipeline(transaction=False)
        for task_id in storable:
            pipe.hmget(self.keys.result(task_id), fields) if fields else pipe.hgetall(self.keys.result(task_id))
        replies = pipe.execute(raise_on_error=False) if storable else []  # a producer's record of another type: none
        if fields:
            replies = [_named(fields, reply) for reply in replies]
        found = dict(zip(storable, replies, strict=True))
        return [record_text_fields(task_id, found[task_id]) if task_id in found else None for task_id in ids]

    def delete_finished(self, tasks: Sequence[tuple[str, str]]) -> list[int]:
        """Delete the records of finished tasks ((queue, task id) pairs) and their history entries, as each reads now.

        Per task DELETED, GONE (no record), KEPT (not finished, as a dead task requeued since the
        caller read it; or cancelled where it waits, until a consumer drops it: see
        lua/delete_finished.lua) or -1 (a key of another type, left alone). One script on one
        server, one per record on Redis Cluster (the records lie in many slots); then the history.
        """
        if not tasks:
            return []
        keys = [self.keys.result(task_id) for _, task_id in tasks]
        if isinstance(self.client, redis.RedisCluster):
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                self.scripts.queue(pipe, "delete_finished", [key], [])
            replies = [int(reply[0]) for reply in self.scripts.execute(pipe, self.client)]
        else:
            replies = [int(reply) for reply in self._script("delete_finished", keys, [])]
        pipe = self.client.pipeline(transaction=False)
        for (queue, task_id), reply in zip(tasks, replies, strict=True):
            for key in index_keys(self.keys, queue) if reply in (DELETED, GONE) else ():
                pipe.zrem(key, task_id)
        pipe.execute()
        return replies


def _named(fields: Sequence[str], reply: list[bytes | None] | Exception) -> dict[bytes, bytes] | Exception:
    """HMGET's reply as HGETALL's: the fields the record has, by name."""
    if isinstance(reply, Exception):
        return reply
    return {name.encode(): value for name, value in zip(fields, reply, strict=True) if value is not None}


def _shown_ties(first: list[tuple[float, bytes, str]], max_ms: float | None, after: str) -> int:
    """How many of a window's `first` rows earlier pages showed: ties scored `max_ms` (from `after` on, if given)."""
    return sum(
        1
        for score, member, _ in first
        if score == max_ms and (not after or member.decode(errors="backslashreplace") >= after)
    )
