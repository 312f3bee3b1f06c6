"""How an executor hands `async def` handlers to its asyncio lane and settles what they return."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

from tasks_app import metrics
from tasks_app.consumer.async_lane import AsyncLane
from tasks_app.consumer.claimed import Claimed
from tasks_app.consumer.retrying import GaveUp
from tasks_app.consumer.settling import Settling
from tasks_app.consumer.timeouts import within_timeout
from tasks_app.context import TaskContext
from tasks_app.django_tasks import runner
from tasks_app.exceptions import ResultNotJson, ResultTooLarge
from tasks_app.protocol import results
from tasks_app.protocol.codec import Arguments, Task
from tasks_app.registry import Handler
from tasks_app.task_types import TaskTypeConfig

logger = logging.getLogger("tasks_app.tasks")


class AsyncRuns(Settling):
    """The asyncio lane's side of an executor: submit a run, settle its outcome from the lane."""

    async_lane: AsyncLane | None
    # The executor's: settles a run's outcome (see Executor._settle_outcome).
    _settle_outcome: Callable[..., bool]
    _run: Callable[..., bool]

    def _run_async(
        self,
        claimed: Claimed,
        task: Task,
        config: TaskTypeConfig,
        handler: Handler,
        context: TaskContext,
        arguments: Arguments,
        max_attempts: int,
        on_settled: Callable[[], None] | None,
    ) -> bool:
        """Hand the run to the lane; it calls `on_settled` once the task is settled (always True)."""
        assert self.async_lane is not None
        coroutine = self.invoke_async(handler, context, arguments, config.timeout_s or None)
        settle = partial(self._settle_safely, claimed, task, config, max_attempts)
        succeed_now = partial(self._succeed_now, claimed, task)
        self.async_lane.submit(coroutine, settle, on_settled or (lambda: None), config.timeout_s or None, succeed_now)
        return True

    def _run_releasing(
        self,
        claimed: Claimed,
        task: Task,
        config: TaskTypeConfig,
        handler: Handler,
        arguments: Arguments,
        on_settled: Callable[[], None] | None,
        release: Callable[[], None],
    ) -> bool:
        """`_run` of an async task holding a max_running slot: the slot is released once it is settled."""

        def settled() -> None:
            release()
            if on_settled is not None:
                on_settled()

        later = False
        try:
            later = self._run(claimed, task, config, handler, arguments, settled)
        finally:
            if not later:
                release()
        return later

    def _succeed_now(
        self, claimed: Claimed, task: Task, value: Any, duration: float, on_settled: Callable[[], None]
    ) -> bool | None:
        """Settle a success through the ack batcher without waiting; None if that cannot be done."""
        if self.acks is None or task.unique_digest:  # freeing a unique key is a round trip
            return None
        try:
            return_json = results.result_json(value, self.max_result_bytes)
        except (ResultNotJson, ResultTooLarge):
            return None  # a failure: settled on a settling thread
        metrics.TASK_DURATION.labels(task.type, task.queue).observe(duration)
        return self._succeed(claimed, task, return_json, duration, on_settled)

    def _settle_safely(self, claimed: Claimed, task: Task, config: TaskTypeConfig, *outcome: Any) -> bool:
        """`_settle_outcome`, dead-letting the task as a last resort if settling fails (see `execute`)."""
        try:
            return self._settle_outcome(claimed, task, config, *outcome)
        except GaveUp:
            raise
        except Exception as exc:
            logger.exception("unexpected error settling a task of queue %s; dead-lettering it", claimed.queue)
            self._dead_letter_after_error(claimed, exc)
            return False

    def invoke_async(
        self, handler: Handler, context: TaskContext, arguments: Arguments, timeout_s: float | None
    ) -> Coroutine[Any, Any, Any]:
        """The coroutine of an `async def` handler's run, cancelled with TaskTimeout at `timeout_s`."""
        if handler.django_task is not None:
            return runner.start_async(handler.django_task, context, arguments, self.broker, timeout_s)
        if handler.takes_context:
            return within_timeout(handler.func(context, *arguments.args, **arguments.kwargs), timeout_s)
        return within_timeout(handler.func(*arguments.args, **arguments.kwargs), timeout_s)

    def async_running(self) -> int:
        """Tasks on the asyncio lane, not yet settled."""
        return self.async_lane.running if self.async_lane is not None else 0

    def close(self) -> None:
        """Stop the asyncio lane's loop (once nothing runs on it)."""
        if self.async_lane is not None:
            self.async_lane.close()
