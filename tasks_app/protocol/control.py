"""Task control in Redis: cancelling through result records, cancel requests of running tasks, pausing queues.

A cancel and a run's start are both decided on the task's result record, so either the task never
runs, or the cancel becomes a request its consumer reads from `cancel_requests` (and `cancel_forced`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from tasks_app.protocol import history, records
from tasks_app.protocol.keys import NAME_PATTERN
from tasks_app.protocol.scripts import Role, reply_text

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
        """Cancel tasks by id in one round trip (two if some run; `force`: stopped by their consumer); never raises."""
        answers = self.redis.run_many("cancel", [([self.keys.result(task_id)], [cancelled_by]) for task_id in task_ids])
        replies = [
            CancelReply(task_id, reply_text(outcome), reply_text(queue), reply_text(status), int(at_ms))
            for task_id, (outcome, queue, status, at_ms, *_) in zip(task_ids, answers, strict=True)
        ]
        pipe = self.client.pipeline(transaction=False)
        for reply, answer in zip(replies, answers, strict=True):
            # Only a record naming a queue ours could serve has its queue told: a foreign writer's name
            # ("", "}x") may spread that queue's keys over a cluster's slots, failing every cancel's writes.
            if NAME_PATTERN.fullmatch(reply.queue) is None:
                continue
            if reply.outcome == CANCELLED:  # the task browser's history: READY to CANCELLED (another slot)
                args = history.status_move_args(reply.task_id, records.CANCELLED, "", history.INDEX_TTL_S)
                self.scripts.queue(pipe, "history_move", history.index_keys(self.keys, reply.queue), args)
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
