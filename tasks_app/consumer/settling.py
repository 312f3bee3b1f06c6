"""Settling a run in Redis: ack, retry later, defer or dead-letter, with the metrics and log line of each."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from tasks_app import metrics
from tasks_app.consumer.claimed import Claimed
from tasks_app.consumer.receipts import withdrawal
from tasks_app.consumer.retry_policy import retries_left, retry_delay_s
from tasks_app.consumer.retrying import GaveUp
from tasks_app.consumer.settle_writes import MAX_ERROR_MESSAGE_BYTES, SettlingWrites
from tasks_app.exceptions import PermanentError
from tasks_app.protocol import results
from tasks_app.protocol.codec import Task, decode_task, encode_task
from tasks_app.protocol.keys import UNDECODABLE_TYPE
from tasks_app.protocol.replies import ResultUpdate, UniqueRelease
from tasks_app.protocol.results import clean_text
from tasks_app.protocol.timestamps import now_ms
from tasks_app.task_types import TaskTypeConfig

logger = logging.getLogger("tasks_app.tasks")


class Settling(SettlingWrites):
    """How an executor settles the tasks it ran; never leaves one unsettled in its processing list."""

    # --- outcomes --------------------------------------------------------------------------
    def _succeed(
        self,
        claimed: Claimed,
        task: Task,
        return_json: str,
        duration_s: float,
        on_settled: Callable[[], None] | None = None,
        release: UniqueRelease | None = None,
    ) -> bool:
        update = results.succeeded(task, return_json, now_ms(), self.result_ttl_s, claimed.fence, run_s=duration_s)
        metrics.of_run(task.type, task.queue).succeeded.inc()
        return self._ack_settled(claimed, task, update, "succeeded", duration_s, on_settled, release)

    def _ack_settled(
        self,
        claimed: Claimed,
        task: Task,
        update: ResultUpdate | None,
        outcome: str,
        duration_s: float | None,
        on_settled: Callable[[], None] | None,
        release: UniqueRelease | None = None,
    ) -> bool:
        """Write `update` and ack the task (freeing `release` if it was still held); True if the ack batcher
        does it (and then calls `on_settled`)."""
        if self.acks is not None:
            # Logged by the batcher's one thread once recorded (eight workers contending for the
            # log handler's lock cost more than the line itself), after every slot of its batch
            # came back: the claimer refills them while the lines are written.
            def acked(held: bool | None) -> None:
                if on_settled is not None:
                    on_settled()
                if held is False:
                    self._ack_lost(claimed, task)

            def log() -> None:
                self._log_event(task, outcome, duration_s)

            self.acks.ack(claimed.queue, claimed.consumer_id, claimed.raw, update, acked, log, release)
            return True
        held = self._settle(
            "ack",
            lambda result: self.broker.ack(
                claimed.queue, claimed.consumer_id, [claimed.raw], [result] if result else [], [release]
            )[0],
            update,
        )
        self._log_event(task, outcome, duration_s)
        if not held:
            self._ack_lost(claimed, task)
        return False

    def _fail(
        self,
        claimed: Claimed,
        task: Task,
        config: TaskTypeConfig,
        error: BaseException,
        traceback_text: str,
        duration_s: float | None = None,
    ) -> None:
        if self.acks is not None:
            self.acks.barrier()  # this run's RUNNING record goes first
        max_attempts = task.max_attempts or config.max_attempts
        error_path = clean_text(f"{type(error).__module__}.{type(error).__qualname__}", MAX_ERROR_MESSAGE_BYTES)
        metrics.TASKS_FAILED.labels(task.type, task.queue).inc()
        task.last_error = clean_text(f"{error_path}: {results.describe_error(error)}", MAX_ERROR_MESSAGE_BYTES)
        task.last_traceback = clean_text(traceback_text, self.max_result_bytes)
        error_entry = results.error_record(error_path, task.last_traceback)
        failed_at_ms = now_ms()
        if retries_left(error, task.attempt, max_attempts):
            delay_s = retry_delay_s(error, task.attempt, config.retry_backoff_s)
            held = self._retry(claimed, task, delay_s, error_entry, failed_at_ms, duration_s)
        else:
            if isinstance(error, PermanentError):
                task.dead_reason = f"permanent error on attempt {task.attempt}: {task.last_error}"
            else:
                task.dead_reason = f"failed {task.attempt} of {max_attempts} attempts; last error: {task.last_error}"
            held = self._dead_letter_failed(claimed, task, config, error_entry, failed_at_ms, duration_s)
        if not held:
            self._ack_lost(claimed, task)

    def _dead_letter_failed(
        self,
        claimed: Claimed,
        task: Task,
        config: TaskTypeConfig,
        error_entry: dict[str, str],
        failed_at_ms: float,
        duration_s: float | None,
    ) -> bool:
        """Dead-letter a task whose run failed for the last time (its `dead_reason` set); False if it was lost."""
        update = results.attempt_failed(
            task,
            error_entry,
            failed_at_ms,
            self.result_ttl_s,
            final=True,
            dead_reason=task.dead_reason,
            fence=claimed.fence,
            run_s=duration_s,
        )
        held = self._dead_letter_raw(claimed, encode_task(task), update, self._release_of(task, config))
        metrics.TASKS_DEAD_LETTERED.labels(task.type, task.queue).inc()
        self._log_event(task, "dead_lettered", duration_s, error=task.last_error)
        return held

    def _retry(
        self,
        claimed: Claimed,
        task: Task,
        delay_s: float,
        error_entry: dict[str, str],
        failed_at_ms: float,
        duration_s: float | None,
    ) -> bool:
        """Put a failed task back in the delayed set, due in `delay_s`; False if it was lost."""
        delay_ms = int(max(delay_s, self.retry_floor_s) * 1000)
        update = results.attempt_failed(
            task,
            error_entry,
            failed_at_ms,
            self.result_ttl_s,
            final=False,
            retry_at_ms=int(failed_at_ms) + delay_ms,
            fence=claimed.fence,
            run_s=duration_s,
        )
        new_raw = encode_task(task)
        held = self._settle(
            "retry",
            lambda result: self.broker.retry_later(
                claimed.queue, claimed.consumer_id, claimed.raw, new_raw, task.priority, delay_ms, result
            ),
            update,
        )
        metrics.TASKS_RETRIED.labels(task.type, task.queue).inc()
        self._log_event(task, "retried", duration_s, error=task.last_error, retry_in_s=delay_ms / 1000)
        return held

    def _dead_letter(
        self, claimed: Claimed, task: Task, error_name: str, reason: str, release: UniqueRelease | None = None
    ) -> None:
        """Dead-letter a task that cannot run at all (no attempt is used)."""
        reason = clean_text(reason, MAX_ERROR_MESSAGE_BYTES)
        task.last_error = f"{error_name}: {reason}"
        task.dead_reason = reason
        update = results.attempt_failed(
            task,
            results.error_record(error_name, reason),
            now_ms(),
            self.result_ttl_s,
            final=True,
            dead_reason=reason,
            fence=claimed.fence,
        )
        held = self._dead_letter_raw(claimed, encode_task(task), update, release)
        metrics.TASKS_DEAD_LETTERED.labels(self._type_label(task.type), task.queue).inc()
        logger.warning(
            "task %s dead-lettered: %s",
            task.id,
            reason,
            extra={
                "task_id": task.id,
                "type": task.type,
                "queue": task.queue,
                "attempt": task.attempt,
                "outcome": "dead_lettered",
            },
        )
        if not held:
            self._ack_lost(claimed, task)

    def _dead_letter_after_error(self, claimed: Claimed, error: BaseException) -> None:
        """The last resort: dead-letter a task whose settling failed, with the error as its reason."""
        reason = clean_text(
            f"settling the task failed: {type(error).__name__}: {results.describe_error(error)}",
            MAX_ERROR_MESSAGE_BYTES,
        )
        new_raw, update, label, release = self._last_resort_entry(claimed, reason)
        try:
            if self.acks is not None:
                self.acks.barrier()  # a RUNNING write this run queued goes first
            # The move alone first: it must not depend on a record write, which may be what failed.
            held = self._dead_letter_raw(claimed, new_raw, None, release)
            if held and update is not None:
                self._record_after("dead letter", update)
        except GaveUp:
            raise
        except Exception:
            logger.exception(
                "could not dead-letter a task of queue %s; it stays held until the lease of consumer %s is lost",
                claimed.queue,
                claimed.consumer_id,
            )
            return
        metrics.TASKS_DEAD_LETTERED.labels(label, claimed.queue).inc()

    def _last_resort_entry(
        self, claimed: Claimed, reason: str
    ) -> tuple[bytes, ResultUpdate | None, str, UniqueRelease | None]:
        """The dead-letter entry, record update, metric label and key to free for a task whose settling failed."""
        try:
            task = decode_task(claimed.raw)
            task.last_error = task.dead_reason = reason
            update = results.attempt_failed(
                task,
                results.error_record("SettleFailed", reason),
                int(time.time() * 1000),
                self.result_ttl_s,
                final=True,
                dead_reason=reason,
                fence=claimed.fence,
            )
            release = self._release_of(task, self.task_types.get(task.type))
            return encode_task(task), update, self._type_label(task.type), release
        except Exception:  # keep the bytes as they are, wrapped like undecodable ones
            wrapped = Task(
                id=str(uuid.uuid4()),
                type=UNDECODABLE_TYPE,
                queue=claimed.queue,
                payload=claimed.raw,
                last_error=reason,
                dead_reason=reason,
            )
            return encode_task(wrapped), None, UNDECODABLE_TYPE, None

    def _dead_letter_undecodable(self, claimed: Claimed, problem: str) -> None:
        """Keep bytes that are not a task, wrapped in one, with the reason."""
        reason = f"undecodable task: {problem}"
        wrapper = Task(
            id=str(uuid.uuid4()),
            type=UNDECODABLE_TYPE,
            queue=claimed.queue,
            payload=claimed.raw,
            last_error=f"UndecodableTask: {problem}",
            dead_reason=reason,
        )
        held = self._dead_letter_raw(claimed, encode_task(wrapper), None)
        metrics.TASKS_DEAD_LETTERED.labels(UNDECODABLE_TYPE, claimed.queue).inc()
        logger.warning(
            "%d undecodable bytes on queue %s dead-lettered: %s",
            len(claimed.raw),
            claimed.queue,
            problem,
            extra={"task_id": wrapper.id, "queue": claimed.queue, "outcome": "dead_lettered"},
        )
        if not held:
            metrics.ACKS_LOST.labels(claimed.queue).inc()

    def _defer(
        self, claimed: Claimed, task: Task, wait_ms: int, reason: str, record: ResultUpdate | None = None
    ) -> None:
        """Put a task back in the delayed set without using an attempt (writing `record`, if given, with the move)."""
        # Unstarted again: its receipt is withdrawn, so that a cancel while it waits cancels it outright.
        withdrawn = record or withdrawal(claimed, task, self.result_ttl_s + wait_ms // 1000 + 1)
        held = self._settle(
            "defer",
            lambda result: self.broker.retry_later(
                claimed.queue, claimed.consumer_id, claimed.raw, claimed.raw, task.priority, wait_ms, result
            ),
            withdrawn,
        )
        metrics.TASKS_DEFERRED.labels(task.type, task.queue, reason).inc()
        if not held:
            self._ack_lost(claimed, task)
