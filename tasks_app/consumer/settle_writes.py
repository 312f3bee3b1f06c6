"""The writes that settle a task: each through Redis outages, with its record; its metric label and log line."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

from redis.exceptions import ResponseError

from tasks_app import metrics
from tasks_app.consumer.ack_batcher import AckBatcher
from tasks_app.consumer.claimed import Claimed
from tasks_app.consumer.retrying import REFUSED_AFTER, WriteRefused, until_done
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task
from tasks_app.protocol.replies import ResultUpdate, UniqueRelease
from tasks_app.registry import Registry
from tasks_app.task_types import TaskTypeCache, TaskTypeConfig

logger = logging.getLogger("tasks_app.tasks")

# Metric label of task types that are neither a TaskType row nor a registered handler: a type
# name read from Redis must not create a label set of its own.
UNKNOWN_TYPE_LABEL = "_unknown"

# The message of a task's outcome line: its id, type, outcome and attempt.
LOG_EVENT_FORMAT = "task %s %s %s (attempt %d)"

# Cap of error messages and dead reasons (tracebacks are capped at max_result_bytes).
MAX_ERROR_MESSAGE_BYTES = 16 * 1024


class SettlingWrites:
    """The executor's writes that move a task on: each through outages, with its record; what they report."""

    broker: Broker
    acks: AckBatcher | None
    registry: Registry
    task_types: TaskTypeCache
    worker_id: str
    result_ttl_s: int
    give_up: threading.Event
    max_result_bytes: int
    # No retry is due sooner (s): set once this process gave up on a hung run and is leaving,
    # so that no copy of a task starts elsewhere while its hung handler still runs here.
    retry_floor_s: float = 0.0

    def _release_of(self, task: Task, config: TaskTypeConfig | None) -> UniqueRelease | None:
        """The uniqueness key that settling `task` for good frees, if its type holds keys until then."""
        if not holds_unique_until_finished(task, config):
            return None
        # Once this process gave up on a hung run, such a run may still go on until the process is
        # gone: the key is freed only then, as no retry is due sooner.
        return UniqueRelease(task.unique_digest, task.id, math.ceil(self.retry_floor_s * 1000))

    def _type_label(self, type_name: str) -> str:
        """The metric label of a task type: its name only if it is a TaskType row or a handler."""
        if self.task_types.get(type_name) is not None or self.registry.get(type_name) is not None:
            return type_name
        return UNKNOWN_TYPE_LABEL

    def _redis[T](self, call: Callable[[], T], what: str) -> T:
        """Run a settling write through outages; WriteRefused once Redis keeps refusing it while answering."""
        return until_done(
            call, what=what, give_up=self.give_up, refused_after=REFUSED_AFTER, redis_answers=self.broker.answers
        )

    def _settle(self, what: str, move: Callable[[ResultUpdate | None], bool], update: ResultUpdate | None) -> bool:
        """Move a task on (ack, retry, defer, dead letter) with its run's record `update` in one call; False if lost.

        If Redis keeps refusing the two (over maxmemory, where a script's first write may not be
        a record's), the move alone, which takes the task out of the list first; then the record,
        fenced by the run (a later run's claim keeps its own). Refused too, the move raises, and
        the last resort (see `_dead_letter_after_error`) leaves the task listed at worst.
        """
        try:
            return self._redis(lambda: move(update), what)
        except WriteRefused as exc:
            if update is None:
                raise
            logger.warning(
                "Redis refused a %s of task %a with its record (%s); moving it alone", what, update.task_id, exc
            )
        held = self._redis(lambda: move(None), what)
        if held:
            self._record_after(what, update)
        return held

    def _record_after(self, what: str, update: ResultUpdate) -> None:
        """Write the record of a run whose task was moved on without it; a refusal is only logged."""
        try:
            self._redis(lambda: self.broker.record_result(update), "record_result")
        except (WriteRefused, ResponseError) as exc:
            logger.error("the record of task %a was not written after its %s: %s", update.task_id, what, exc)

    def _dead_letter_raw(
        self, claimed: Claimed, new_raw: bytes, update: ResultUpdate | None, release: UniqueRelease | None = None
    ) -> bool:
        return self._settle(
            "dead_letter",
            lambda result: self.broker.dead_letter(
                claimed.queue, claimed.consumer_id, claimed.raw, new_raw, result, release
            ),
            update,
        )

    def _ack_lost(self, claimed: Claimed, task: Task) -> None:
        metrics.ACKS_LOST.labels(claimed.queue).inc()
        logger.warning(
            "task %s was no longer held by consumer %s (its lease expired and it was recovered); "
            "its outcome here was not applied",
            task.id,
            claimed.consumer_id,
            extra={"task_id": task.id, "type": task.type, "queue": task.queue, "outcome": "ack_lost"},
        )

    def _log_event(self, task: Task, outcome: str, duration_s: float | None, **extra: Any) -> None:
        level = logging.INFO if outcome == "succeeded" else logging.WARNING
        if not logger.isEnabledFor(level):
            return
        fields = {
            "task_id": task.id,
            "type": task.type,
            "queue": task.queue,
            "attempt": task.attempt,
            "duration_s": round(duration_s, 6) if duration_s is not None else None,
            "outcome": outcome,
            **extra,
        }
        # makeRecord + handle is what logger.log does, less its search of the stack for the caller's
        # file and line (no format of ours shows them): a line per task, thousands a second.
        args = (task.id, task.type, outcome, task.attempt)
        logger.handle(logger.makeRecord(logger.name, level, "", 0, LOG_EVENT_FORMAT, args, None, extra=fields))


def holds_unique_until_finished(task: Task, config: TaskTypeConfig | None) -> bool:
    """Whether `task` holds a uniqueness key that its end (not the window's) frees."""
    return bool(task.unique_digest) and config is not None and config.unique_until == TaskType.UniqueUntil.FINISHED
