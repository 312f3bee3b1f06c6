"""How an executor hands `async def` handlers to its asyncio lane and settles what they return.

An async run is watched like a thread run (`Executor.running`, keyed by its RunControl): the
housekeeping tick tells it of cancels and writes its progress, and a forced cancel cancels its
asyncio task. It leaves the watch when it ends, its last progress written just before its outcome.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any, NoReturn

from tasks_app import metrics
from tasks_app.consumer.async_lane import AsyncLane, Flight, LaneSlot
from tasks_app.consumer.claimed import Claimed
from tasks_app.consumer.concurrency import ConcurrencyGate
from tasks_app.consumer.control import Running, RunWatch, progress_update
from tasks_app.consumer.pause_watch import PauseWatch
from tasks_app.consumer.retrying import GaveUp
from tasks_app.consumer.run_start import no_start_check
from tasks_app.consumer.settling import Settling
from tasks_app.consumer.timeouts import RunClock, within_timeout
from tasks_app.context import RunControl, TaskContext, running
from tasks_app.django_tasks import runner
from tasks_app.exceptions import ResultNotJson, ResultTooLarge
from tasks_app.protocol import results
from tasks_app.protocol.codec import Arguments, Task
from tasks_app.registry import Handler
from tasks_app.task_types import TaskTypeConfig

logger = logging.getLogger("tasks_app.tasks")

# Why a task whose worker was still passing its gates (rate limit, max_running, its start) when a stop's
# grace period ended goes back unstarted: a run starting then would be abandoned by the exiting process.
AFTER_GRACE = "passed its gates only after the grace period of the stop ended"


async def as_current[T](context: TaskContext, start: Callable[[], Awaitable[T]]) -> T:
    """Await what `start()` returns, with `context` as what `tasks_app.context.current()` returns in it.

    Nothing is made before this coroutine begins: closed unstarted, it leaves no coroutine unawaited.
    """
    with running(context):
        return await start()


async def _handler_run(
    handler: Handler, context: TaskContext, arguments: Arguments, timeout_s: float | None, begin: Callable[[], None]
) -> Any:
    """Call an `async def` handler once `begin()` let it begin, and await it under its timeout."""
    begin()
    args = (context, *arguments.args) if handler.takes_context else arguments.args
    return await within_timeout(handler.func(*args, **arguments.kwargs), timeout_s)


async def _raising(error: BaseException) -> NoReturn:
    raise error


class AsyncRuns(Settling):
    """The asyncio lane's side of an executor: submit a run, settle its outcome from the lane."""

    async_lane: AsyncLane | None
    # The executor's: the runs the housekeeping tick watches, and the watch.
    running: dict[object, Running]
    _running_lock: threading.Lock
    watch: RunWatch
    # The executor's: settles a run's outcome (see Executor._settle_outcome).
    _settle_outcome: Callable[..., bool]
    _run: Callable[..., bool]
    # The executor's: a task's rate limit and max_running slot ("" uncapped, None deferred), and its cap.
    _admit: Callable[[Claimed, Task, TaskTypeConfig, Arguments], str | None]
    concurrency: ConcurrencyGate | None
    _watch: Callable[[object, Running], bool]  # the executor's: False once no run may start (see run_limits)
    pauses: PauseWatch  # the executor's: it puts claimed tasks back unstarted

    def _run_async(
        self,
        claimed: Claimed,
        task: Task,
        config: TaskTypeConfig,
        handler: Handler,
        context: TaskContext,
        arguments: Arguments,
        on_settled: Callable[[], None] | None,
        slot: LaneSlot,
        begin: Callable[[], None],
    ) -> bool:
        """Hand the run to the lane in `slot`, watched; it calls `on_settled` once the task is settled (always True).

        `begin` is called on the loop as the run begins (see `invoke_async`).
        """
        lane = self.async_lane
        assert lane is not None
        timeout_s = config.timeout_s or None
        settle = partial(self._settle_safely, context.control, claimed, task, config)
        flight = Flight(settle, timeout_s, partial(self._succeed_now, context.control, claimed, task, config))
        run = Running(task, RunClock(None), context, claimed.fence, claimed, config, partial(lane.cancel, flight))
        if not self._watch(context.control, run):
            return self._return_stopping(claimed, AFTER_GRACE)
        coroutine = self.invoke_async(handler, context, arguments, timeout_s, begin)
        lane.submit(coroutine, flight, on_settled or (lambda: None), slot)
        return True

    def _return_stopping(self, claimed: Claimed, waited: str) -> bool:
        """Put back unstarted a task that `waited` until the consumer stopped: it must not start now (False)."""
        self.pauses.return_unstarted(claimed)
        logger.info("stopping: a task that %s went back to pending unstarted", waited)
        return False

    def _unwatch(self, control: RunControl) -> None:
        """Stop watching an async run that ended; write the progress it set since the last tick (before its outcome)."""
        with self._running_lock:
            run = self.running.pop(control, None)
        last_progress = progress_update(run, self.result_ttl_s) if run is not None else None
        if last_progress is not None:
            self.watch.record(last_progress)

    def _execute_async(
        self,
        claimed: Claimed,
        task: Task,
        config: TaskTypeConfig,
        handler: Handler,
        arguments: Arguments,
        on_settled: Callable[[], None] | None,
    ) -> bool:
        """Pass an async task's gates and start it on the lane; True if the lane settles it (and calls `on_settled`).

        Its lane slot comes first: a rate admission is taken only once its run can begin at once, not
        spent while it waits for room on a full lane (past its start margin).
        """
        lane = self.async_lane
        assert lane is not None
        slot = lane.reserve()
        if slot is None:
            return self._return_stopping(claimed, "waited for room on the asyncio lane")
        try:
            holder = self._admit(claimed, task, config, arguments)
            if holder is None:
                return False
            run = partial(self._run, claimed, task, config, handler, arguments, lane_slot=slot)
            if holder and self.concurrency is not None:
                return self._run_releasing(run, on_settled, partial(self.concurrency.release, holder))
            return run(on_settled)
        finally:
            slot.give_back()  # unless its run took it

    def _run_releasing(
        self,
        run: Callable[[Callable[[], None] | None], bool],
        on_settled: Callable[[], None] | None,
        release: Callable[[], None],
    ) -> bool:
        """`run` (its `_run` given what to call once settled) of an async task holding a max_running slot:
        the slot is released once the task is settled."""

        def settled() -> None:
            # Once this process gave up on a hung run (which it cannot tell from the others here),
            # that run may still go on until the process is gone: the slot stays held, renewed
            # until then, and lapses with the lease after.
            if not self.retry_floor_s:
                release()
            if on_settled is not None:
                on_settled()

        later = False
        try:
            later = run(settled)
        finally:
            if not later:
                release()
        return later

    def _succeed_now(
        self,
        control: RunControl,
        claimed: Claimed,
        task: Task,
        config: TaskTypeConfig,
        value: Any,
        duration: float,
        on_settled: Callable[[], None],
    ) -> bool | None:
        """Settle a success through the ack batcher without waiting; None if that cannot be done."""
        if self.acks is None:
            return None
        try:
            return_json = results.result_json(value, self.max_result_bytes)
        except (ResultNotJson, ResultTooLarge):
            return None  # a failure: settled on a settling thread
        self._unwatch(control)  # the batcher only queues its progress write, before the ack
        metrics.of_run(task.type, task.queue).duration.observe(duration)
        return self._succeed(claimed, task, return_json, duration, on_settled, self._release_of(task, config))

    def _settle_safely(
        self, control: RunControl, claimed: Claimed, task: Task, config: TaskTypeConfig, *outcome: Any
    ) -> bool:
        """`_settle_outcome`, dead-letting the task as a last resort if settling fails (see `execute`)."""
        try:
            self._unwatch(control)
            return self._settle_outcome(claimed, task, config, *outcome)
        except GaveUp:
            raise
        except BaseException as exc:  # as in `execute`
            logger.exception("unexpected error settling a task of queue %s; dead-lettering it", claimed.queue)
            self._dead_letter_after_error(claimed, exc)
            return False

    def invoke_async(
        self,
        handler: Handler,
        context: TaskContext,
        arguments: Arguments,
        timeout_s: float | None,
        begin: Callable[[], None] = no_start_check,
    ) -> Coroutine[Any, Any, Any]:
        """The coroutine of an `async def` handler's run, cancelled with TaskTimeout at `timeout_s`.

        It calls `begin` first, on its loop: what that raises (StartMissed, if the loop lets it begin
        only past its rate admission's start margin) ends it before the handler is called.
        The handler's own coroutine is made only as it begins: one closed before then (a forced
        cancel, a loop that cannot take it) leaves no coroutine unawaited.

        What calling the handler raises (arguments its signature does not take), or sending a
        task_started receiver's error, is raised by the coroutine: the run fails as one that
        raised, and is retried like any other, never dead-lettered as a settling failure.
        """
        if handler.django_task is None:
            return as_current(context, partial(_handler_run, handler, context, arguments, timeout_s, begin))
        try:
            with running(context):  # task_started, sent now, sees the run as current
                start = runner.start_async(handler.django_task, context, arguments, self.broker, timeout_s, begin)
        except BaseException as exc:  # as call_with_clock catches a sync handler's
            start = partial(_raising, exc)
        return as_current(context, start)

    def async_running(self) -> int:
        """Tasks on the asyncio lane, not yet settled."""
        return self.async_lane.running if self.async_lane is not None else 0

    def close(self) -> None:
        """Stop the asyncio lane's loop (once nothing runs on it)."""
        if self.async_lane is not None:
            self.async_lane.close()
