"""Settling a run in Redis: ack, retry later, defer, dead-letter or cancel, with the metrics and log line of each.

Whatever goes wrong while settling, the task is dead-lettered at last (`dead_letter_after_error`).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

from django.conf import settings
from redis.exceptions import ResponseError

from tasks_app import metrics, workflows
from tasks_app.consumer.ack_batcher import AckBatcher, through_outages
from tasks_app.consumer.claiming import Claimed, withdrawal
from tasks_app.consumer.gates import StartMissed
from tasks_app.consumer.loops import GaveUp, WriteRefused, until_done
from tasks_app.exceptions import PermanentError, ResultNotJson, ResultTooLarge, Retry, TaskCancelled
from tasks_app.models import TaskType
from tasks_app.protocol import records
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task, UndecodableTask, decode_task, encode_task
from tasks_app.protocol.history import CancelMark
from tasks_app.protocol.keys import UNDECODABLE_TYPE
from tasks_app.protocol.queue import UniqueRelease
from tasks_app.protocol.records import ResultUpdate, clean_text, now_ms
from tasks_app.protocol.workflows import Owner
from tasks_app.registry import Registry
from tasks_app.task_types import TaskTypeCache, TaskTypeConfig

logger = logging.getLogger("tasks_app.tasks")

# Metric label of a type that is neither a TaskType row nor a handler: no label set per name read from Redis.
UNKNOWN_TYPE_LABEL = "_unknown"
# The message of a task's outcome line: its id, type, outcome and attempt.
LOG_EVENT_FORMAT = "task %s %s %s (attempt %d)"
# Cap of error messages and dead reasons (tracebacks are capped at max_result_bytes).
MAX_ERROR_MESSAGE_BYTES = 16 * 1024
# A task that waited here unstarted this long asks for cancels before it starts (see claim receipts).
CANCEL_CHECK_S = 0.25

MAX_BACKOFF_S = 3600.0
MAX_DOUBLINGS = 1023


def backoff_delay_s(attempt: int, base_s: float, rng: random.Random | None = None) -> float:
    """Return the wait before the run after failed run `attempt` (1-based)."""
    ceiling = min(MAX_BACKOFF_S, base_s * 2.0 ** min(max(0, attempt - 1), MAX_DOUBLINGS))
    return (rng or random).uniform(ceiling / 2, ceiling)


def retries_left(error: BaseException, attempt: int, max_attempts: int) -> bool:
    """True if a run that failed with `error` on `attempt` runs again: attempts left, and the error not permanent."""
    return attempt < max_attempts and not isinstance(error, PermanentError)


def retry_delay_s(error: BaseException, attempt: int, base_s: float) -> float:
    """The wait before the next run: what a `Retry` asked for (at most TASKS_MAX_DELAY_S), else the backoff."""
    if isinstance(error, Retry) and error.in_s is not None:
        return min(error.in_s, float(settings.TASKS_MAX_DELAY_S))
    return backoff_delay_s(attempt, base_s)


def holds_unique_until_finished(task: Task, config: TaskTypeConfig | None) -> bool:
    """Whether `task` holds a uniqueness key that its end (not the window's) frees."""
    return bool(task.unique_digest) and config is not None and config.unique_until == TaskType.UniqueUntil.FINISHED


def _formatted(error: BaseException) -> str:
    """`error`'s traceback as text, or a line saying it cannot be shown (its own code raised while formatted)."""
    try:
        return "".join(traceback.format_exception(error))
    except BaseException:  # traceback shields from an Exception in __str__, not from SystemExit and its kin
        return f"{type(error).__qualname__} (its traceback cannot be shown: formatting it raised)\n"


def log_fields(task: Task, outcome: str) -> dict[str, Any]:
    """The fields of a log line about `task` (its id, type, queue and attempt) and its `outcome`."""
    return {"task_id": task.id, "type": task.type, "queue": task.queue, "attempt": task.attempt, "outcome": outcome}


def _wrapped(claimed: Claimed, last_error: str, reason: str) -> Task:
    """A task holding claimed bytes as they are, for their dead letter."""
    return Task(
        id=str(uuid.uuid4()),
        type=UNDECODABLE_TYPE,
        queue=claimed.queue,
        payload=claimed.raw,
        last_error=last_error,
        dead_reason=reason,
    )


class Settler:
    """Moves a task on once its run ended, or once it must not run: each write through outages, with its record."""

    def __init__(
        self,
        broker: Broker,
        registry: Registry,
        task_types: TaskTypeCache,
        result_ttl_s: int,
        *,
        acks: AckBatcher,
        give_up: threading.Event | None = None,
    ) -> None:
        self.broker = broker
        self.registry = registry
        self.task_types = task_types
        self.result_ttl_s = result_ttl_s
        self.acks = acks
        # Set when the consumer stops: settling then gives up on an absent Redis (the lease recovers the task).
        self.give_up = give_up or threading.Event()
        self.max_result_bytes = int(settings.TASKS_MAX_RESULT_BYTES)
        # No retry is due sooner (s): set once this process gave up on a hung run and is leaving.
        self.retry_floor_s = 0.0

    def settle_outcome(
        self,
        claimed: Claimed,
        task: Task,
        config: TaskTypeConfig,
        return_json: str | None,
        error: BaseException | None,
        raised: BaseException | None,
        duration: float,
        on_settled: Callable[[], None] | None,
    ) -> bool:
        """Settle a run whose value `stored` made `return_json`, or that failed with `error`; True if the ack
        batcher calls `on_settled`."""
        if not isinstance(error, StartMissed):
            metrics.of_run(task.type, task.queue).duration.observe(duration)
        if error is None:  # `stored` gave its JSON
            return self.succeed(claimed, task, return_json or "null", duration, on_settled, config)
        if isinstance(error, TaskCancelled):
            return self.cancelled(claimed, task, config, on_settled, duration)
        self.acks.barrier()  # this run's RUNNING record goes first
        if isinstance(error, StartMissed):  # its handler never began: sent back
            self.defer(
                claimed, task, 0, "rate_start_missed", records.start_undone(task, claimed.fence, self.result_ttl_s)
            )
            return False
        traceback_text = _formatted(error)
        if raised is not None and raised is not error:
            traceback_text += "\nThe handler, interrupted at its timeout, raised:\n" + _formatted(raised)
        max_attempts = task.max_attempts or config.max_attempts
        error_path = clean_text(f"{type(error).__module__}.{type(error).__qualname__}", MAX_ERROR_MESSAGE_BYTES)
        metrics.TASKS_FAILED.labels(task.type, task.queue).inc()
        task.last_error = clean_text(f"{error_path}: {records.describe_error(error)}", MAX_ERROR_MESSAGE_BYTES)
        task.last_traceback = clean_text(traceback_text, self.max_result_bytes)
        error_entry = records.error_record(error_path, task.last_traceback)
        if not retries_left(error, task.attempt, max_attempts):
            if isinstance(error, PermanentError):
                task.dead_reason = f"permanent error on attempt {task.attempt}: {task.last_error}"
            else:
                task.dead_reason = f"failed {task.attempt} of {max_attempts} attempts; last error: {task.last_error}"
            self._dead_letter_final(claimed, task, error_entry, config, duration)
            self._log_event(task, "dead_lettered", duration, error=task.last_error)
            return False
        failed_at_ms = now_ms()
        delay_ms = int(max(retry_delay_s(error, task.attempt, config.retry_backoff_s), self.retry_floor_s) * 1000)
        update = records.attempt_failed(
            task,
            error_entry,
            failed_at_ms,
            self.result_ttl_s,
            final=False,
            retry_at_ms=int(failed_at_ms) + delay_ms,
            fence=claimed.fence,
            run_s=duration,
        )
        self._retry_later(claimed, task, encode_task(task), delay_ms, update)
        metrics.TASKS_RETRIED.labels(task.type, task.queue).inc()
        self._log_event(task, "retried", duration, error=task.last_error, retry_in_s=delay_ms / 1000)
        return False

    def stored(self, value: Any, error: BaseException | None) -> tuple[str | None, BaseException | None]:
        """A run's return value as its record stores it, or the error that fails the run: its own, or that the value
        cannot be stored."""
        if error is not None:
            return None, error
        try:
            return records.result_json(value, self.max_result_bytes), None
        except (ResultNotJson, ResultTooLarge) as exc:
            return None, exc

    def last_resort(self, claimed: Claimed, settle: Callable[[], bool]) -> bool:
        """`settle()`, dead-lettering the task as a last resort if it fails; what `settle()` returned, else False."""
        try:
            return settle()
        except GaveUp:
            raise
        except BaseException as exc:  # a bug, a write Redis refuses, a handler's odd object: never leave it held
            logger.exception("unexpected error settling a task of queue %s; dead-lettering it", claimed.queue)
            self.dead_letter_after_error(claimed, exc)
            return False

    def succeed(
        self,
        claimed: Claimed,
        task: Task,
        return_json: str,
        duration_s: float,
        on_settled: Callable[[], None] | None,
        config: TaskTypeConfig,
    ) -> bool:
        """Record a success and ack the task; True if the ack batcher does it (and then calls `on_settled`)."""
        kept_s = config.kept_for_s(records.SUCCESSFUL, self.result_ttl_s)
        update = records.succeeded(task, return_json, now_ms(), kept_s, claimed.fence, run_s=duration_s)
        metrics.of_run(task.type, task.queue).succeeded.inc()
        self.workflow_end(claimed, task, workflows.SUCCESSFUL, return_json)
        release = self.release_of(task, config)
        return self.ack_settled(claimed, task, update, "succeeded", duration_s, on_settled, release)

    def ack_settled(
        self,
        claimed: Claimed,
        task: Task,
        update: ResultUpdate | None,
        outcome: str,
        duration_s: float | None,
        on_settled: Callable[[], None] | None,
        release: UniqueRelease | None = None,
    ) -> bool:
        """Have the ack batcher write `update`, ack the task (freeing `release`), then call `on_settled`; True."""

        def acked(held: bool | None) -> None:
            if on_settled is not None:
                on_settled()
            if held is False:
                self._ack_lost(claimed, task)

        # Logged by one thread after the flush: workers contending for the log handler's lock cost more.
        log = partial(self._log_event, task, outcome, duration_s)
        self.acks.ack(claimed.queue, claimed.consumer_id, claimed.raw, update, acked, log, release)
        return True

    def _dead_letter_final(
        self,
        claimed: Claimed,
        task: Task,
        error_entry: dict[str, str],
        config: TaskTypeConfig | None,
        duration_s: float | None = None,
    ) -> None:
        """Dead-letter a task with its FAILED record (its `dead_reason` set)."""
        update = records.attempt_failed(
            task,
            error_entry,
            now_ms(),
            self.kept_s(task, records.FAILED),
            final=True,
            dead_reason=task.dead_reason,
            fence=claimed.fence,
            run_s=duration_s,
        )
        self.workflow_end(claimed, task, workflows.FAILED, workflows.failed_value(task.id, task.last_error))
        if not self._dead_letter_raw(claimed, encode_task(task), update, self.release_of(task, config)):
            self._ack_lost(claimed, task)
        metrics.TASKS_DEAD_LETTERED.labels(self.type_label(task.type), task.queue).inc()

    def dead_letter(
        self, claimed: Claimed, task: Task, error_name: str, reason: str, config: TaskTypeConfig | None = None
    ) -> None:
        """Dead-letter a task that cannot run at all (no attempt used), freeing the unique key of a known type."""
        reason = clean_text(reason, MAX_ERROR_MESSAGE_BYTES)
        task.last_error = f"{error_name}: {reason}"
        task.dead_reason = reason
        self._dead_letter_final(claimed, task, records.error_record(error_name, reason), config)
        logger.warning("task %s dead-lettered: %s", task.id, reason, extra=log_fields(task, "dead_lettered"))

    def dead_letter_after_error(self, claimed: Claimed, error: BaseException) -> None:
        """The last resort: dead-letter a task whose settling failed, with the error as its reason."""
        reason = clean_text(
            f"settling the task failed: {type(error).__name__}: {records.describe_error(error)}",
            MAX_ERROR_MESSAGE_BYTES,
        )
        try:
            task = decode_task(claimed.raw)
            task.last_error = task.dead_reason = reason
            update: ResultUpdate | None = records.attempt_failed(
                task,
                records.error_record("SettleFailed", reason),
                int(time.time() * 1000),
                self.kept_s(task, records.FAILED),
                final=True,
                dead_reason=reason,
                fence=claimed.fence,
            )
            release = self.release_of(task, self.task_types.get(task.type))
            new_raw, label = encode_task(task), self.type_label(task.type)
        except Exception:  # keep the bytes as they are, wrapped like undecodable ones
            new_raw, label = encode_task(_wrapped(claimed, reason, reason)), UNDECODABLE_TYPE
            update = release = None
        try:
            self.acks.barrier()  # a RUNNING write this run queued goes first
            # The move alone first: it must not depend on a record write, which may be what failed.
            held = self._dead_letter_raw(claimed, new_raw, None, release)
            if held and update is not None:
                self._record_after("dead letter", update)
        except GaveUp:
            raise
        except Exception:
            message = "could not dead-letter a task of queue %s; it stays held until the lease of consumer %s is lost"
            logger.exception(message, claimed.queue, claimed.consumer_id)
            return
        metrics.TASKS_DEAD_LETTERED.labels(label, claimed.queue).inc()

    def dead_letter_undecodable(self, claimed: Claimed, problem: str) -> None:
        """Keep bytes that are not a task, wrapped in one, with the reason."""
        reason = f"undecodable task: {problem}"
        wrapper = _wrapped(claimed, f"UndecodableTask: {problem}", reason)
        held = self._dead_letter_raw(claimed, encode_task(wrapper), None)
        metrics.TASKS_DEAD_LETTERED.labels(UNDECODABLE_TYPE, claimed.queue).inc()
        extra = {"task_id": wrapper.id, "queue": claimed.queue, "outcome": "dead_lettered"}
        message = "%d undecodable bytes on queue %s dead-lettered: %s"
        logger.warning(message, len(claimed.raw), claimed.queue, problem, extra=extra)
        if not held:
            metrics.ACKS_LOST.labels(claimed.queue).inc()

    def defer(
        self, claimed: Claimed, task: Task, wait_ms: int, reason: str, record: ResultUpdate | None = None
    ) -> None:
        """Put a task back in the delayed set without using an attempt (writing `record`, if given, with the move)."""
        # Its receipt withdrawn: a cancel while it waits cancels it outright.
        withdrawn = record or withdrawal(claimed, task, self.result_ttl_s + wait_ms // 1000 + 1)
        self._retry_later(claimed, task, claimed.raw, wait_ms, withdrawn, "defer")
        metrics.TASKS_DEFERRED.labels(task.type, task.queue, reason).inc()

    def cancelled(
        self,
        claimed: Claimed,
        task: Task,
        config: TaskTypeConfig | None,
        on_settled: Callable[[], None] | None,
        duration_s: float | None = None,
        update: ResultUpdate | None = None,
    ) -> bool:
        """Ack a cancelled task (before it started if `duration_s` is None, else its handler raised TaskCancelled)."""
        metrics.TASKS_CANCELLED.labels(self.type_label(task.type), task.queue).inc()  # its type may be gone
        kept_s = self.kept_s(task, records.CANCELLED)
        if duration_s is not None:
            update = records.cancelled(task, int(time.time() * 1000), kept_s, claimed.fence)
        update = update or records.dropped_cancelled(task, kept_s, claimed.fence)
        outcome = "cancelled" if duration_s is not None else "cancelled_before_start"
        cancelled_entry = workflows.failed_value(task.id, workflows.CANCELLED_ERROR)
        self.workflow_end(claimed, task, workflows.CANCELLED, cancelled_entry)
        return self.ack_settled(claimed, task, update, outcome, duration_s, on_settled, self.release_of(task, config))

    def drop_if_cancelled_while_held(
        self, claimed: Claimed, task: Task, config: TaskTypeConfig, on_settled: Callable[[], None] | None
    ) -> bool | None:
        """Drop a receipted task that waited here CANCEL_CHECK_S or more if it was cancelled meanwhile."""
        if claimed.receipt is None or time.monotonic() - claimed.claimed_at_s < CANCEL_CHECK_S:
            return None
        [mark] = self.redis(lambda: self.broker.control.cancel_marks(task.queue, [task.id]), "cancel_marks")
        if mark == CancelMark.NONE:
            return None
        cancelled = records.cancelled(
            task, int(time.time() * 1000), self.kept_s(task, records.CANCELLED), claimed.fence
        )
        return self.cancelled(claimed, task, config, on_settled, update=cancelled)

    def workflow_end(self, claimed: Claimed, task: Task, outcome: str, value_json: str) -> None:
        """Record the end of a workflow's task while this run owns it: before the ack, so a kill re-records it."""
        if workflows.is_member(task.headers):
            owner = Owner(claimed.queue, claimed.consumer_id, claimed.raw)
            self.redis(lambda: workflows.task_ended(self.broker, task.headers, outcome, value_json, owner), "workflow")

    def kept_s(self, task: Task, status: str) -> int:
        """How long the record of `task`, ended with `status`, is kept (s): its type's choice; 0 none."""
        return self.task_types.kept_for_s(task.type, status, self.result_ttl_s)

    def release_of(self, task: Task, config: TaskTypeConfig | None) -> UniqueRelease | None:
        """The uniqueness key that settling `task` for good frees, if its type holds keys until then."""
        if not holds_unique_until_finished(task, config):
            return None
        # A hung run given up on may go on until the process is gone: the key is freed only then.
        return UniqueRelease(task.unique_digest, task.id, math.ceil(self.retry_floor_s * 1000))

    def type_label(self, type_name: str) -> str:
        """The metric label of a task type: its name only if it is a TaskType row or a handler."""
        if self.task_types.get(type_name) is not None or self.registry.get(type_name) is not None:
            return type_name
        return UNKNOWN_TYPE_LABEL

    def redis[T](self, call: Callable[[], T], what: str) -> T:
        """Run a settling write through outages; WriteRefused once Redis keeps refusing it while answering."""
        return through_outages(self.broker, self.give_up, call, what)

    def _settle(self, what: str, move: Callable[[ResultUpdate | None], bool], update: ResultUpdate | None) -> bool:
        """Move a task on (ack, retry, defer, dead letter) with its run's record `update` in one call; False if lost."""
        # If Redis keeps refusing the two (over maxmemory): the move alone, then the record, fenced by the run.
        try:
            return self.redis(lambda: move(update), what)
        except WriteRefused as exc:
            if update is None:
                raise
            logger.warning(
                "Redis refused a %s of task %a with its record (%s); moving it alone", what, update.task_id, exc
            )
        held = self.redis(lambda: move(None), what)
        if held:
            self._record_after(what, update)
        return held

    def _record_after(self, what: str, update: ResultUpdate) -> None:
        """Write the record of a run whose task was moved on without it; a refusal is only logged."""
        try:
            self.redis(lambda: self.broker.records.record_result(update), "record_result")
        except (WriteRefused, ResponseError) as exc:
            logger.error("the record of task %a was not written after its %s: %s", update.task_id, what, exc)

    def _retry_later(
        self,
        claimed: Claimed,
        task: Task,
        new_raw: bytes,
        delay_ms: int,
        update: ResultUpdate | None,
        what: str = "retry",
    ) -> None:
        held = self._settle(
            what,
            lambda result: self.broker.queue.retry_later(
                claimed.queue, claimed.consumer_id, claimed.raw, new_raw, task.priority, delay_ms, result
            ),
            update,
        )
        if not held:
            self._ack_lost(claimed, task)

    def _dead_letter_raw(
        self, claimed: Claimed, new_raw: bytes, update: ResultUpdate | None, release: UniqueRelease | None = None
    ) -> bool:
        return self._settle(
            "dead_letter",
            lambda result: self.broker.queue.dead_letter(
                claimed.queue, claimed.consumer_id, claimed.raw, new_raw, result, release
            ),
            update,
        )

    def _ack_lost(self, claimed: Claimed, task: Task) -> None:
        metrics.ACKS_LOST.labels(claimed.queue).inc()
        message = (
            "task %s was no longer held by consumer %s (its lease expired and it was recovered); "
            "its outcome here was not applied"
        )
        logger.warning(message, task.id, claimed.consumer_id, extra=log_fields(task, "ack_lost"))

    def _log_event(self, task: Task, outcome: str, duration_s: float | None, **extra: Any) -> None:
        level = logging.INFO if outcome == "succeeded" else logging.WARNING
        if not logger.isEnabledFor(level):
            return
        duration = round(duration_s, 6) if duration_s is not None else None
        fields = {**log_fields(task, outcome), "duration_s": duration, **extra}
        # logger.log less its search of the stack for the caller (no format of ours shows it): thousands a second.
        args = (task.id, task.type, outcome, task.attempt)
        logger.handle(logger.makeRecord(logger.name, level, "", 0, LOG_EVENT_FORMAT, args, None, extra=fields))


def record_reaped(
    broker: Broker, task_types: TaskTypeCache, queue: str, dead: list[bytes], *, give_up: threading.Event
) -> None:
    """Count, log and record as failed the tasks of a dead consumer that the reaper dead-lettered."""
    reaped_logger = logging.getLogger("tasks_app.consumer.lifecycle")  # these lines were always the consumer's
    at_ms = int(time.time() * 1000)
    for raw in dead:
        try:
            task = decode_task(raw)
        except UndecodableTask:
            continue
        task.queue = queue  # an envelope's empty or other queue: where it died wins, as for a run
        metrics.TASKS_DEAD_LETTERED.labels(task.type, queue).inc()
        extra = {"task_id": task.id, "type": task.type, "queue": queue, "outcome": "dead_lettered"}
        reaped_logger.error("task %s dead-lettered: %s", task.id, task.dead_reason, extra=extra)
        error = records.error_record("ConsumerDied", task.dead_reason)
        kept_s = task_types.kept_for_s(task.type, records.FAILED, int(settings.TASKS_RESULT_TTL))
        update = records.attempt_failed(task, error, at_ms, kept_s, final=True, dead_reason=task.dead_reason)
        # Each write whether or not the one before it could be made: the task is dead either way.
        record = partial(broker.records.record_result, update)
        writes: list[tuple[str, Callable[[], object], str]] = [
            ("record_result", record, "could not record dead-lettered task %s as failed: %s")
        ]
        if workflows.is_member(task.headers):  # it failed for good: its workflow learns it (no run owns it now)
            value = workflows.failed_value(task.id, task.last_error or task.dead_reason)
            ended = partial(workflows.task_ended, broker, task.headers, workflows.FAILED, value)
            writes.append(("workflow", ended, "could not record dead-lettered task %s in its workflow: %s"))
        if holds_unique_until_finished(task, task_types.get(task.type)):
            release = partial(broker.control.release_unique, queue, task.unique_digest, task.id)
            writes.append(("release_unique", release, "could not free the uniqueness key of dead-lettered task %s: %s"))
        for what, write, failure in writes:
            try:
                until_done(write, what=what, give_up=give_up)
            except Exception as exc:
                reaped_logger.error(failure, task.id, exc)
