"""The start of a run: count the attempt, write its RUNNING record, and check it may still start."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any

from tasks_app import metrics
from tasks_app.consumer.claimed import Claimed
from tasks_app.consumer.limits import check_start
from tasks_app.consumer.settling import Settling
from tasks_app.protocol import results
from tasks_app.protocol.codec import Arguments, Task
from tasks_app.protocol.replies import ResultUpdate
from tasks_app.protocol.timestamps import now_ms
from tasks_app.registry import Handler
from tasks_app.task_types import TaskTypeConfig

INT32_MAX = 2**31 - 1  # the envelope's attempt field


def count_run(attempt: int) -> int:
    """The run count of a task starting a run: a foreign count below 0 reads as 0, one at int32's end stays there."""
    return min(max(attempt, 0) + 1, INT32_MAX)


def no_start_check() -> None:
    """The start check of a run that no rate limit admitted: it may begin whenever its worker gets to it."""


class NotStarted(enum.Enum):
    """Why a claimed task's run must not start."""

    CANCELLED = "cancelled"  # its record says it was cancelled before it started
    SUPERSEDED = "superseded"  # a later claim's token is on the record: that claim runs it
    LEASE_LOST = "lease lost"  # the lease lapsed while the start was written: the reaper owns it


class RunStart(Settling):
    """The executor's side of starting a run."""

    # Waits while the claim's lease may have lapsed; False once it is lost (None: no lease to check).
    lease_check: Callable[[Claimed], bool] | None

    def _record_start(
        self, claimed: Claimed, task: Task, config: TaskTypeConfig, handler: Handler, arguments: Arguments
    ) -> int | NotStarted:
        """Count the attempt and record its start (RUNNING record, metrics: a rate admission's once its handler
        begins); return the task's attempt limit, or why it must not start."""
        if claimed.receipt == results.SUPERSEDED:
            return NotStarted.SUPERSEDED
        task.attempt = count_run(task.attempt)
        max_attempts = task.max_attempts or config.max_attempts
        started_ms = now_ms()
        started_update = results.started(
            task,
            arguments,
            self.worker_id,
            started_ms,
            max_attempts,
            self.result_ttl_s,
            claimed.fence,
            record_exists=claimed.receipt == results.RECEIPT_OF_RECORD,
        )
        reply = self._write_start(claimed, handler, started_update)
        if reply == results.START_REFUSED:
            return NotStarted.CANCELLED
        if reply == results.SUPERSEDED:
            return NotStarted.SUPERSEDED
        # The write may have waited for Redis (or this process been stopped meanwhile): a lease
        # lost since is the reaper's to hand on, and this run's record is fenced off by then.
        if self.lease_check is not None and not self.lease_check(claimed):
            return NotStarted.LEASE_LOST
        if claimed.suspect and not self._mark_suspect_started(claimed):
            return NotStarted.LEASE_LOST
        if claimed.start_by == math.inf:  # else counted as its handler begins (`_begin_admitted`), if it does
            self._count_start(task, started_ms)
        return max_attempts

    def _begin_admitted(self, task: Task, start_by: float) -> None:
        """Let the handler of a task its rate limit admitted begin, counting its start; StartMissed past `start_by`."""
        check_start(start_by)
        self._count_start(task, now_ms())

    def _start_again(self, claimed: Claimed, task: Task) -> bool:
        """Send back a task whose handler could not begin within its rate admission's start margin (False).

        Due at once, no attempt used, its record READY again: its gate asks the limiter anew, and the
        admission it missed stays spent, so no window of the limit gains a start.
        """
        if self.acks is not None:
            self.acks.barrier()  # its RUNNING record goes first
        self._defer(claimed, task, 0, "rate_start_missed", results.start_undone(task, claimed.fence, self.result_ttl_s))
        return False

    def _mark_suspect_started(self, claimed: Claimed) -> bool:
        """Make a suspect's start durable before its handler runs (a death from now on is the task's
        fault); False if the lease lapsed first: the run must not start, and the task is not blamed."""
        return self._redis(
            lambda: self.broker.mark_started(claimed.queue, claimed.consumer_id, claimed.raw), "mark_started"
        )

    def _count_start(self, task: Task, started_ms: float) -> None:
        """The metrics of a run that starts now: one more start, and how long a first run waited."""
        run_metrics = metrics.of_run(task.type, task.queue)
        run_metrics.started.inc()
        waited_since_ms = task.run_after_ms or task.enqueued_at_ms
        if waited_since_ms and task.attempt == 1:
            run_metrics.wait.observe(max(0.0, (started_ms - waited_since_ms) / 1000))

    def _write_start(self, claimed: Claimed, handler: Handler, started_update: ResultUpdate) -> Any:
        """Write a run's RUNNING update; Redis's reply (None: not waited for, the receipt decided)."""
        if self.acks is not None and handler.django_task is None and claimed.receipt is not None:
            self.acks.record(started_update)  # goes out with the next flush
            return None
        if self.acks is not None and handler.django_task is None:
            return self.acks.record_start(started_update)  # shares a flush with other workers' writes
        # A @task function reads its own record when it starts.
        return self._redis(lambda: self.broker.record_result(started_update), "record_result")
