"""Time limits of an executor's running tasks: TaskTimeout at their timeout, in process mode giving
up on those still running a grace period later (their process is then replaced), and giving up on
those still running when a stop's grace period ends."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from tasks_app.consumer.async_lane import AsyncLane, Flight, HungFlight
from tasks_app.consumer.control import ControlSettling, Running
from tasks_app.consumer.timeouts import failure_traceback
from tasks_app.exceptions import TaskInterrupted

logger = logging.getLogger("tasks_app.tasks")


class RunLimits(ControlSettling):
    """The executor's side of time limits, over the runs it watches."""

    # The executor's: the runs it watches, and its asyncio lane.
    running: dict[object, Running]
    _running_lock: threading.Lock
    # Set (under _running_lock) when a stop's grace period ends: no run starts after it.
    _starts_closed = False
    async_lane: AsyncLane | None
    _hung_settlers: list[threading.Thread]  # threads settling the runs `fail_hung` gave up on
    _settle_outcome: Callable[..., bool]  # the executor's: settles a run's outcome

    def expire_overdue(self) -> int:
        """Raise TaskTimeout in every run past its timeout; each is settled once its handler returns."""
        now = time.monotonic()
        with self._running_lock:
            overdue = [run for run in self.running.values() if run.clock.overdue(now)]
        interrupted = 0
        for run in overdue:
            if run.clock.interrupt():
                interrupted += 1
                logger.warning(
                    "task %s exceeded its timeout of %g s: TaskTimeout raised in its handler; "
                    "it stays held until the handler returns",
                    run.task.id,
                    run.clock.timeout_s,
                    extra={
                        "task_id": run.task.id,
                        "type": run.task.type,
                        "queue": run.task.queue,
                        "attempt": run.task.attempt,
                        "outcome": "timed_out",
                    },
                )
        return interrupted

    def fail_hung(self, grace_s: float, exit_within_s: float) -> int:
        """Give up on every run still going `grace_s` after its TaskTimeout (failed) or forced cancel (cancelled).

        For process mode only, where the process then exits (within `exit_within_s`): the
        handler's thread is left to it, and its late outcome is never settled (the claim's fence
        makes it harmless anyway). No retry is due before the process is gone. The runs are
        settled on a thread of their own: Redis may be away, and the caller's other time limits
        must not wait for it.
        """
        now = time.monotonic()
        with self._running_lock:
            hung = [run for run in self.running.values() if run.clock.abandon(grace_s, now)]
        hung_async = self.async_lane.take_hung(grace_s) if self.async_lane is not None else []
        if not hung and not hung_async:
            return 0
        self._settle_apart(self._settle_hung, (hung, hung_async, grace_s, now), exit_within_s)
        return len(hung) + len(hung_async)

    def interrupt_running(self, grace_s: float, exit_within_s: float) -> int:
        """Give up on every run still going at the end of a stop's grace period (`grace_s`); how many.

        Each is failed with TaskInterrupted (or the timeout or forced cancel due in it), so it uses
        an attempt, and its late end is never settled. The process then exits (within
        `exit_within_s`): no retry is due before. Settled on a thread of its own, as `fail_hung` does.
        """
        with self._running_lock:  # thread runs (an async one is stopped through its asyncio task)
            self._starts_closed = True  # a worker still passing its gates must not start its run after this
            runs = [run for run in self.running.values() if run.stop is None and run.clock.give_up()]
        flights = self.async_lane.take_unsettled() if self.async_lane is not None else []
        if not runs and not flights:
            return 0
        error = TaskInterrupted(f"the consumer stopped, and the run still went on {grace_s:g} s after the stop")
        self._settle_apart(self._settle_interrupted, (runs, flights, error), exit_within_s)
        return len(runs) + len(flights)

    def _watch(self, key: object, run: Running) -> bool:
        """Watch `run` as it starts; False if it must not start: a stop's grace period ended (see interrupt_running)."""
        with self._running_lock:
            if self._starts_closed:
                return False
            self.running[key] = run
            return True

    def _settle_apart(self, settle: Callable[..., None], args: tuple[Any, ...], exit_within_s: float) -> None:
        """Call `settle(*args)` on a thread of its own; no retry is due before this process is gone."""
        self.retry_floor_s = max(self.retry_floor_s, exit_within_s)
        settler = threading.Thread(target=settle, args=args, name="hard-limits", daemon=True)
        self._hung_settlers.append(settler)
        settler.start()

    def wait_hung_settled(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the runs given up on to be settled (before their tasks could be returned)."""
        deadline = time.monotonic() + timeout_s
        for settler in self._hung_settlers:
            settler.join(max(0.0, deadline - time.monotonic()))

    def _settle_hung(self, hung: list[Running], hung_async: list[HungFlight], grace_s: float, now: float) -> None:
        for run in hung:
            try:
                if run.clock.cancel_error is not None:
                    self._end_forced_run(run, grace_s, now)
                else:
                    self._fail_hung_run(run, grace_s, now)
            except Exception:  # its lease recovers it once the process is gone
                logger.exception("could not settle hung task %s", run.task.id)
        if self.async_lane is not None:
            self.async_lane.settle_hung(hung_async, grace_s)

    def _settle_interrupted(self, runs: list[Running], flights: list[Flight], error: TaskInterrupted) -> None:
        now = time.monotonic()
        for run in runs:
            assert run.claimed is not None and run.config is not None
            clock = run.clock
            due = clock.cancel_error or clock.timeout_error or error
            try:
                duration_s = now - clock.started_monotonic
                self._settle_outcome(run.claimed, run.task, run.config, None, due, None, duration_s, None)
            except Exception:  # its lease recovers it once the process is gone
                logger.exception("could not settle interrupted task %s", run.task.id)
        if self.async_lane is not None:
            self.async_lane.fail_taken(flights, error)

    def _fail_hung_run(self, run: Running, grace_s: float, now: float) -> None:
        assert run.claimed is not None and run.config is not None and run.clock.timeout_error is not None
        logger.error(
            "task %s still running %g s past its timeout: failed, and its process will be replaced",
            run.task.id,
            grace_s,
            extra={"task_id": run.task.id, "type": run.task.type, "queue": run.task.queue, "outcome": "hung"},
        )
        error = run.clock.timeout_error
        duration_s = now - run.clock.started_monotonic
        self._fail(run.claimed, run.task, run.config, error, failure_traceback(error, None), duration_s)

    def hung(self) -> int:
        """How many runs were given up by `fail_hung` and have not returned."""
        with self._running_lock:
            return sum(1 for run in self.running.values() if run.clock.abandoned)
