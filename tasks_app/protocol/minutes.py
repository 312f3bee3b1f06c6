"""Per-minute counters of each queue for the dashboard's charts: outcomes, durations and backlog.

One hash per queue and minute (``minute:<epoch s // 60>``, in the queue's hash tag) with fields
``ok``, ``failed`` and ``retried`` (all types), the same with ``|<type>`` (type names cannot hold
``|``), ``d|<type>|<bucket>`` (runs whose duration fell in DURATION_BUCKETS_MS[bucket]) and
``backlog`` (tasks waiting, sampled by the consumers' schedulers). Written with the result writes:
on one server by record_result itself, for the writes the records take; on Redis Cluster (the
record in a slot of its own) in the round trip of the writes, aggregated per flush, and taken back
for those the records did not take (see replication.py). Each hash expires after KEEP_MINUTES.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from django.tasks import TaskResultStatus

from tasks_app.protocol.replies import ResultUpdate, stored_int
from tasks_app.protocol.scripts import ScriptClient

KEEP_MINUTES = 120
# The range of a Redis integer (HINCRBY): a count outside it was written by no counter.
MAX_COUNT = 2**63 - 1

# Upper bounds of the duration buckets (ms); the last bucket holds everything slower.
DURATION_BUCKETS_MS: tuple[float, ...] = (
    1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 300000,
)  # fmt: skip

OUTCOMES = ("ok", "failed", "retried")
READY, SUCCESSFUL, FAILED = (
    s.value for s in (TaskResultStatus.READY, TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED)
)


def outcome_of(update: ResultUpdate) -> str | None:
    """Which counter a result write adds to: a success, a final failure, a retry; None for others."""
    status = update.fields.get("status")
    if not update.queue or status is None:
        return None
    if status == SUCCESSFUL:
        return "ok"
    if status == FAILED:
        return "failed"
    if status == READY and "run_after_ms" in update.fields and update.run_s is not None:
        return "retried"
    return None


def bucket_of(duration_ms: float) -> int:
    """The index of the duration bucket `duration_ms` falls in."""
    return bisect.bisect_left(DURATION_BUCKETS_MS, duration_ms)


def counter_fields(update: ResultUpdate) -> list[str]:
    """The fields of its queue's minute hash that a result write adds 1 to, if the record takes it."""
    outcome = outcome_of(update)
    if outcome is None:
        return []
    fields = [outcome, f"{outcome}|{update.task_type}"]
    if update.run_s is not None:
        fields.append(f"d|{update.task_type}|{bucket_of(update.run_s * 1000)}")
    return fields


def count_updates(updates: Iterable[ResultUpdate], minute: int) -> dict[tuple[str, int], Counter[str]]:
    """The increments of each (queue, minute) hash that `updates` add up to."""
    counts: dict[tuple[str, int], Counter[str]] = {}
    for update in updates:
        fields = counter_fields(update)
        if fields:
            counts.setdefault((update.queue, minute), Counter()).update(fields)
    return counts


class MinuteOps(ScriptClient):
    """Writing and reading the per-minute counters."""

    def _queue_minute_counts(self, pipe: Any, updates: Sequence[ResultUpdate], minute: int, sign: int = 1) -> None:
        """Add the counters of `updates` to `minute`'s hashes in a pipeline (after its other commands: their
        replies are not read); `sign` -1 takes them back."""
        for (queue, minute_of), fields in count_updates(updates, minute).items():
            key = self.keys.minute(queue, minute_of)
            for name, amount in fields.items():
                pipe.hincrby(key, name, sign * amount)
            pipe.expire(key, KEEP_MINUTES * 60)

    def _uncount_unwritten(self, updates: Sequence[ResultUpdate], replies: Sequence[Any], minute: int) -> None:
        """Take back the counts of result writes the record did not take (ignored by their fence, or refused)."""
        unwritten = [update for update, reply in zip(updates, replies, strict=True) if reply != 1]
        if any(outcome_of(update) for update in unwritten):
            pipe = self.client.pipeline(transaction=False)
            self._queue_minute_counts(pipe, unwritten, minute, sign=-1)
            pipe.execute()

    def sample_backlog(self, queue: str) -> int:
        """Store how many tasks of `queue` wait (pending, prioritized, suspects, delayed) in this minute's hash."""
        pipe = self.client.pipeline(transaction=False)
        pipe.llen(self.keys.pending(queue))
        pipe.zcard(self.keys.prioritized(queue))
        pipe.llen(self.keys.suspects(queue))
        pipe.zcard(self.keys.delayed(queue))
        backlog = int(sum(pipe.execute()))
        key = self.keys.minute(queue, int(time.time()) // 60)
        pipe.hset(key, "backlog", backlog)
        pipe.expire(key, KEEP_MINUTES * 60)
        pipe.execute()
        return backlog

    def minute_counts(self, queue: str, minutes: Sequence[int]) -> list[dict[str, int]]:
        """The counters of `queue` for each of `minutes` (empty where nothing was counted)."""
        pipe = self.client.pipeline(transaction=False)
        for minute in minutes:
            pipe.hgetall(self.keys.minute(queue, minute))
        return [_ints(raw) for raw in pipe.execute()]


def _ints(raw: dict[bytes, bytes]) -> dict[str, int]:
    return {key.decode(errors="backslashreplace"): stored_int(value) or 0 for key, value in raw.items()}
