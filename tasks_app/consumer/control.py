"""Task control on a consumer: cancelled tasks dropped unrun, cancel requests and progress of running ones.

The start of a run is its RUNNING write (`record_result.lua`), which Redis refuses for a cancelled
task: the worker then acks the task without running it. Running handlers learn of a cancel from
`RunWatch`, which the housekeeping loop ticks: one round trip per queue with running tasks every
CANCEL_CHECK_S (the ids' scores in `cancel_requests` and `cancel_forced`), no polling per task.
A forced cancel also stops the run: TaskCancelled raised in its thread or its coroutine (and, in
process mode, a run still going a grace period later is abandoned: see process_mode.py).
Progress set by handlers is written by the same tick through the ack batcher, at most every
PROGRESS_EVERY_S per task, and once more when the run ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tasks_app import metrics
from tasks_app.consumer.claimed import Claimed
from tasks_app.consumer.settling import Settling
from tasks_app.consumer.timeouts import RunClock
from tasks_app.context import TaskContext
from tasks_app.protocol import results
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task
from tasks_app.protocol.control import CancelMark
from tasks_app.protocol.jsontext import compact_json
from tasks_app.protocol.replies import ResultUpdate
from tasks_app.task_types import TaskTypeConfig

logger = logging.getLogger("tasks_app.tasks")

CANCEL_CHECK_S = 0.25
PROGRESS_EVERY_S = 0.25


@dataclass(slots=True)  # not frozen: one per run, and frozen costs four times as much to build
class Running:
    """A task whose handler is running, watched for its timeout, cancel requests and progress."""

    task: Task
    clock: RunClock
    context: TaskContext | None = None
    fence: int = 0
    # What a hard limit needs to settle the run from another thread (process mode).
    claimed: Claimed | None = None
    config: TaskTypeConfig | None = None
    # How a forced cancel stops it (None: TaskCancelled raised in its thread, through its clock).
    stop: Callable[[], object] | None = None

    def force_stop(self) -> None:
        """Stop the run for a forced cancel: TaskCancelled raised where it runs."""
        if self.stop is not None:
            self.stop()
        else:
            self.clock.force_cancel()


def progress_update(run: Running, ttl_s: int) -> ResultUpdate | None:
    """The record update carrying the progress the handler set since the last one (None if it set none)."""
    progress = run.context.control.take_progress() if run.context is not None else None
    if progress is None:
        return None
    fields = {"progress": compact_json(progress)}
    return ResultUpdate(run.task.id, fields, ttl_s, fence=run.fence, queue=run.task.queue, task_type=run.task.type)


class RunWatch:
    """Tells running handlers of cancel requests and writes their progress; ticked by the housekeeping loop."""

    def __init__(self, broker: Broker, record: Callable[[ResultUpdate], object], result_ttl_s: int) -> None:
        self.broker = broker
        self.record = record
        self.result_ttl_s = result_ttl_s
        self._checked_at = self._progress_at = float("-inf")

    def tick(self, runs: Sequence[Running]) -> None:
        """Write due progress, and every CANCEL_CHECK_S mark the runs whose task someone cancelled."""
        now = time.monotonic()
        if now - self._progress_at >= PROGRESS_EVERY_S:
            self._progress_at = now
            for run in runs:
                update = progress_update(run, self.result_ttl_s)
                if update is not None:
                    self.record(update)
        if not runs or now - self._checked_at < CANCEL_CHECK_S:
            return
        self._checked_at = now
        by_queue: dict[str, list[Running]] = {}
        for run in runs:
            if run.context is not None and not run.context.control.forced:
                by_queue.setdefault(run.task.queue, []).append(run)
        for queue_runs in by_queue.values():
            for run, mark in self._marks(queue_runs):
                self._tell(run, mark)

    def _marks(self, runs: list[Running]) -> list[tuple[Running, CancelMark]]:
        """What was asked of each of these runs of one queue."""
        return list(zip(runs, self.broker.cancel_marks(runs[0].task.queue, [run.task.id for run in runs]), strict=True))

    @staticmethod
    def _tell(run: Running, mark: CancelMark) -> None:
        """Pass a cancel request on to its run: the flag it polls, and for a forced one, TaskCancelled."""
        if run.context is None:
            return
        control = run.context.control
        if mark == CancelMark.FORCED:
            control.force()
            run.force_stop()
            logger.warning("task %s was cancelled with force while running: TaskCancelled raised in it", run.task.id)
        elif mark == CancelMark.REQUESTED and not control.cancelled:
            control.cancel()
            logger.info("task %s was cancelled while running; its handler is told", run.task.id)


class ControlSettling(Settling):
    """How an executor ends cancelled runs: dropped unrun, stopped by their handler, or given up on."""

    watch: RunWatch

    def _drop_cancelled(
        self,
        claimed: Claimed,
        task: Task,
        config: TaskTypeConfig | None,
        on_settled: Callable[[], None] | None,
        update: ResultUpdate | None = None,
    ) -> bool:
        """Ack a task cancelled before it started, unrun (`update`: its record's write, if it is not CANCELLED yet)."""
        metrics.TASKS_CANCELLED.labels(self._type_label(task.type), task.queue).inc()  # its type may be gone
        update = update or results.dropped_cancelled(task, self.result_ttl_s, claimed.fence)
        release = self._release_of(task, config)
        return self._ack_settled(claimed, task, update, "cancelled_before_start", None, on_settled, release)

    def _drop_if_cancelled_while_held(
        self, claimed: Claimed, task: Task, config: TaskTypeConfig, on_settled: Callable[[], None] | None
    ) -> bool | None:
        """Drop a receipted task that waited here unstarted for CANCEL_CHECK_S or more if it was cancelled meanwhile.

        None if it was not (it goes on), else what `_drop_cancelled` returned. Its receipt made a
        cancel since then a request to this consumer, which runs no watch over waiting tasks: one
        round trip, only for tasks that waited (a prefetch behind slow runs).
        """
        if claimed.receipt is None or time.monotonic() - claimed.claimed_at_s < CANCEL_CHECK_S:
            return None
        [mark] = self._redis(lambda: self.broker.cancel_marks(task.queue, [task.id]), "cancel_marks")
        if mark == CancelMark.NONE:
            return None
        cancelled = results.cancelled(task, int(time.time() * 1000), self.result_ttl_s, claimed.fence)
        return self._drop_cancelled(claimed, task, config, on_settled, cancelled)

    def _end_cancelled(
        self,
        claimed: Claimed,
        task: Task,
        config: TaskTypeConfig,
        duration_s: float,
        on_settled: Callable[[], None] | None,
    ) -> bool:
        """Settle a run whose handler raised TaskCancelled: CANCELLED, not retried."""
        metrics.TASKS_CANCELLED.labels(task.type, task.queue).inc()
        update = results.cancelled(task, int(time.time() * 1000), self.result_ttl_s, claimed.fence)
        release = self._release_of(task, config)
        return self._ack_settled(claimed, task, update, "cancelled", duration_s, on_settled, release)

    def _end_forced_run(self, run: Running, grace_s: float, now: float) -> None:
        """Settle a run still going `grace_s` after its forced cancel: CANCELLED; its process is then replaced."""
        assert run.claimed is not None and run.config is not None
        logger.error(
            "task %s still running %g s after a forced cancel: cancelled, and its process will be replaced",
            run.task.id,
            grace_s,
            extra={"task_id": run.task.id, "type": run.task.type, "queue": run.task.queue, "outcome": "cancelled"},
        )
        last_progress = progress_update(run, self.result_ttl_s)
        if last_progress is not None:
            self.watch.record(last_progress)
        self._end_cancelled(run.claimed, run.task, run.config, now - run.clock.started_monotonic, None)
