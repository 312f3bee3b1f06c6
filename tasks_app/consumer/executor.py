"""Running one claimed task: decode, gate, call its handler, then ack, retry or dead-letter.

Whatever goes wrong while doing so, the task is settled here (`execute` dead-letters it with the
reason as a last resort): a task this consumer holds never stays in its processing list unsettled.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from redis.exceptions import RedisError, ResponseError

from tasks_app import metrics
from tasks_app.consumer.ack_batcher import AckBatcher
from tasks_app.consumer.async_lane import AsyncLane, LaneSlot
from tasks_app.consumer.async_runs import AFTER_GRACE, AsyncRuns
from tasks_app.consumer.claimed import Claimed
from tasks_app.consumer.concurrency import ConcurrencyGate, key_token_of
from tasks_app.consumer.control import Running, RunWatch, progress_update
from tasks_app.consumer.forks import call_unforked
from tasks_app.consumer.limits import Admission, StartMissed
from tasks_app.consumer.pause_watch import PauseWatch
from tasks_app.consumer.retrying import GaveUp
from tasks_app.consumer.run_limits import RunLimits
from tasks_app.consumer.run_start import NotStarted, RunStart, no_start_check
from tasks_app.consumer.timeouts import RunClock, call_with_clock, failure_traceback
from tasks_app.context import TaskContext, running
from tasks_app.django_tasks import runner
from tasks_app.exceptions import ResultNotJson, ResultTooLarge, TaskCancelled
from tasks_app.protocol import results
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Arguments, Task, UndecodableTask, decode_payload, decode_task
from tasks_app.protocol.keys import delayed_member
from tasks_app.registry import Handler, Registry
from tasks_app.task_types import TaskTypeCache, TaskTypeConfig

logger = logging.getLogger("tasks_app.tasks")

# A task of a disabled type waits this long before its type is looked at again; enabling the type
# wakes it at once (see protocol/disabled.py), so a long wait costs nothing but keeps a big backlog
# from being claimed and deferred again every few seconds.
DISABLED_RECHECK_MS = 300_000
# A task whose type's settings could not be read (the database away) is looked at again this soon.
SETTINGS_RECHECK_MS = 5000
# How long the note of a task deferred for its disabled type outlives the last such deferral.
DISABLED_NOTE_TTL_MS = 2 * DISABLED_RECHECK_MS
SETTINGS_UNREADABLE = "the task types cannot be read"


def _max_result_bytes() -> int:
    from django.conf import settings

    return int(settings.TASKS_MAX_RESULT_BYTES)


RateGate = Callable[[Task, TaskTypeConfig, str | None], Admission]
"""Admits a task (its handler to begin by the admission's `start_by`), else says how many ms to
wait before it may (the third argument: the token of the task's `rate_limit_key` value, None when
the limit is not keyed)."""


class Executor(AsyncRuns, RunLimits, RunStart):
    """Runs claimed tasks on worker threads and settles them in Redis."""

    def __init__(
        self,
        broker: Broker,
        registry: Registry,
        task_types: TaskTypeCache,
        worker_id: str,
        result_ttl_s: int,
        rate_gate: RateGate | None = None,
        give_up: threading.Event | None = None,
        acks: AckBatcher | None = None,
        max_result_bytes: int | None = None,
        concurrency: ConcurrencyGate | None = None,
        async_lane: AsyncLane | None = None,
        lease_check: Callable[[Claimed], bool] | None = None,
    ) -> None:
        self.broker = broker
        self.lease_check = lease_check  # waits while the claim's lease may have lapsed; False once lost
        # With a batcher, RUNNING records and acks of successful runs go out in shared round
        # trips and the worker moves on at once; without one, each is written before returning.
        self.acks = acks
        self.registry = registry
        self.task_types = task_types
        self.worker_id = worker_id
        self.result_ttl_s = result_ttl_s
        self.rate_gate = rate_gate
        self.concurrency = concurrency
        # Where `async def` handlers run (without one, on the worker thread, to completion).
        self.async_lane = async_lane
        # Set when the consumer stops: settling then gives up on an absent Redis (the lease
        # recovers the task); until then a finished task is never left in limbo.
        self.give_up = give_up or threading.Event()
        self.pauses = PauseWatch(broker, self.give_up, result_ttl_s)
        # Runs being watched: thread runs by thread id, async runs by their RunControl.
        self.running: dict[object, Running] = {}
        self._running_lock = threading.Lock()
        self._hung_settlers: list[threading.Thread] = []
        self.max_result_bytes = max_result_bytes if max_result_bytes is not None else _max_result_bytes()
        self.watch = RunWatch(broker, acks.record if acks is not None else broker.record_result, result_ttl_s)

    # --- entry points ----------------------------------------------------------------------
    def execute(self, claimed: Claimed, on_settled: Callable[[], None] | None = None) -> bool:
        """Run a claimed task to its end; True if the ack batcher settles it (and then calls `on_settled`)."""
        try:
            if self.pauses.return_if_paused(claimed):  # paused since it was claimed: it does not start
                return False
            return self._execute(claimed, on_settled)
        except GaveUp:
            raise
        except BaseException as exc:  # a bug, a write Redis refuses, a handler's odd object: never leave it held
            logger.exception("unexpected error settling a task of queue %s; dead-lettering it", claimed.queue)
            self._dead_letter_after_error(claimed, exc)
            return False

    def _execute(self, claimed: Claimed, on_settled: Callable[[], None] | None) -> bool:
        try:
            task = claimed.task if claimed.task is not None else decode_task(claimed.raw)
        except UndecodableTask as exc:
            self._dead_letter_undecodable(claimed, str(exc))
            return False
        if task.queue != claimed.queue:  # a foreign envelope's empty or other queue: where it was claimed wins
            task.queue = claimed.queue
        config, problem = self._resolve(task, claimed.claimed_at_s)
        if claimed.receipt == results.START_REFUSED:  # cancelled before its claim: dropped, whatever its type
            return self._drop_cancelled(claimed, task, config, on_settled)
        if problem == SETTINGS_UNREADABLE:
            return self._defer_unknown_settings(claimed, task)
        if config is None:
            self._dead_letter(claimed, task, "UnknownTaskType", problem)
            return False
        handler = self._handler_of(claimed, task, config)
        if handler is None:
            return False
        if not config.enabled:
            self._defer(claimed, task, DISABLED_RECHECK_MS, "disabled")
            self._note_disabled(claimed, task)
            return False
        try:
            arguments = decode_payload(task.payload)
        except UndecodableTask as exc:
            self._dead_letter_unrunnable(claimed, task, config, "InvalidPayload", str(exc))
            return False
        if (dropped := self._drop_if_cancelled_while_held(claimed, task, config, on_settled)) is not None:
            return dropped  # before its gates: a task cancelled while it waited takes no rate or slot
        if handler.is_async and self.async_lane is not None:
            return self._execute_async(claimed, task, config, handler, arguments, on_settled)
        holder = self._admit(claimed, task, config, arguments)
        if holder is None:
            return False
        try:
            return self._run(claimed, task, config, handler, arguments, on_settled)
        finally:
            if holder and self.concurrency is not None:
                self.concurrency.release(holder)

    def _defer_unknown_settings(self, claimed: Claimed, task: Task) -> bool:
        """Defer a task whose TaskType row could not be read (the database away): it may have one."""
        # Its row may set limits, a timeout or another handler: running it with defaults would
        # ignore them, and calling its type unknown would dead-letter it.
        self._defer(claimed, task, SETTINGS_RECHECK_MS, "settings_unknown")
        return False

    def _note_disabled(self, claimed: Claimed, task: Task) -> None:
        """Note a task just deferred for its disabled type, to be woken when the type is enabled."""
        try:
            self.broker.note_disabled(claimed.queue, task.type, task.priority, claimed.raw, DISABLED_NOTE_TTL_MS)
        except RedisError as exc:  # it comes back at its recheck instead
            logger.debug("could not note a task of disabled type %s for its wake-up: %s", task.type, exc)

    def _handler_of(self, claimed: Claimed, task: Task, config: TaskTypeConfig) -> Handler | None:
        """The task's handler; None if none is registered under its name (the task is dead-lettered)."""
        # A TaskType row may name a `@django.tasks.task` function this process has not imported yet.
        handler = self.registry.get(config.handler) or self.registry.load_django_task(config.handler)
        if handler is None:
            reason = f"handler {config.handler!r} of task type {task.type!r} is not registered"
            if self.registry.import_errors:
                reason += f" (handler modules that failed to import: {self.registry.import_errors})"
            self._dead_letter_unrunnable(claimed, task, config, "HandlerNotRegistered", reason)
        return handler

    def _dead_letter_unrunnable(
        self, claimed: Claimed, task: Task, config: TaskTypeConfig, error_name: str, reason: str
    ) -> None:
        """Dead-letter a task of a known type that cannot run: it failed for good, so its unique key is freed."""
        self._dead_letter(claimed, task, error_name, reason, self._release_of(task, config))

    def _admit(self, claimed: Claimed, task: Task, config: TaskTypeConfig, arguments: Arguments) -> str | None:
        """Pass the rate limit, then take a concurrency slot; None: deferred, else the slot's holder ("": uncapped)."""
        if config.rate_limit and self.rate_gate is not None:
            key_token = key_token_of(config.rate_limit_key, arguments)
            admission = self.rate_gate(task, config, key_token)
            if admission.wait_ms > 0:
                self._defer(claimed, task, admission.wait_ms, "rate_limited")
                self._due_at_its_slot(claimed, task, key_token)
                return None
            claimed.start_by = admission.start_by  # its handler begins by then, or it waits again
        gate = self.concurrency
        if not config.max_running or gate is None:
            return ""
        slots = gate.slots_of(config, arguments)
        holder = gate.acquire(claimed, task, slots)
        if holder is None:
            self._defer(claimed, task, gate.recheck_ms(), "max_running")
            gate.wait(claimed, task, slots)
        return holder

    def _due_at_its_slot(self, claimed: Claimed, task: Task, key_token: str | None) -> None:
        """Bring a task the rate limit just deferred to its slot as its limiter holds it now (gone: due now)."""
        # A follow-up of a change made since the denial (by another consumer, or by this one's
        # refresh after its settings were read) may have scanned the delayed set before this landed.
        try:
            due_us, now_us = self._redis(
                lambda: self.broker.rate_deferred(task.type, key_token, task.id, claimed.queue), "defer"
            )
        except ResponseError as exc:  # a misconfigured limiter key: the task keeps the slot it was given
            logger.warning("could not check the rate limit slot of deferred task %s: %s", task.id, exc)
            return
        current = self.task_types.get(task.type)  # read after: a refresh before that call is seen here
        gone = current is None or not current.rate_limit or due_us <= now_us
        due_ms = now_us // 1000 if gone else math.ceil(due_us / 1000)
        member = delayed_member(task.priority, claimed.raw)
        self._redis(lambda: self.broker.bring_forward(claimed.queue, {member: due_ms}), "defer")

    def watch_running(self) -> None:
        """Tell handlers of cancels and write their progress (the housekeeping tick; time limits: TimeLimitLoop)."""
        with self._running_lock:
            runs = list(self.running.values())
        self.watch.tick(runs)

    # --- the run ---------------------------------------------------------------------------
    def _resolve(self, task: Task, claimed_at_s: float) -> tuple[TaskTypeConfig | None, str]:
        """The task's settings; else None and why (SETTINGS_UNREADABLE: ask again later)."""
        config = self.task_types.get(task.type)
        needs_rows = config is None and (self.registry.get(task.type) is None or not self.task_types.loaded)
        if needs_rows:
            # A row created since the last refresh (say, a new `@task`'s first enqueue) must not be
            # missed: reload before calling the type unknown, or before trusting a handler's
            # defaults while no row was ever read. Once per claim, not per task: a read begun
            # after the claim holds every row its tasks' producers created.
            if not self.task_types.holds_rows_since(claimed_at_s):
                return None, SETTINGS_UNREADABLE
            config = self.task_types.get(task.type)
        if config is not None:
            return config, ""
        if self.registry.get(task.type) is not None:
            return TaskTypeConfig.default_for(task.type), ""
        return None, f"unknown task type {task.type!r}: no TaskType row and no handler of that name"

    def _run(
        self,
        claimed: Claimed,
        task: Task,
        config: TaskTypeConfig,
        handler: Handler,
        arguments: Arguments,
        on_settled: Callable[[], None] | None = None,
        lane_slot: LaneSlot | None = None,
    ) -> bool:
        """Start a task that passed its gates: on the asyncio lane in `lane_slot` if given, else on this thread."""
        if self._starts_closed:  # most such tasks are met here, before their start is written
            return self._return_stopping(claimed, AFTER_GRACE)
        if self.lease_check is not None and not self.lease_check(claimed):
            return False  # its lease was lost while it passed the gates: the reaper owns it now
        max_attempts = self._record_start(claimed, task, config, handler, arguments)
        if isinstance(max_attempts, NotStarted):
            return self._not_started(max_attempts, claimed, task, config, on_settled)
        context = TaskContext(
            task.id, task.type, task.queue, task.attempt, max_attempts, dict(task.headers), claimed.consumer_id
        )
        # A rate admission's start is checked, and counted, as its handler begins (see _record_start).
        admitted = claimed.start_by != math.inf
        begin = partial(self._begin_admitted, task, claimed.start_by) if admitted else no_start_check
        if lane_slot is not None:
            return self._run_async(claimed, task, config, handler, context, arguments, on_settled, lane_slot, begin)
        clock = RunClock(config.timeout_s or None)
        run = Running(task, clock, context, claimed.fence, claimed, config)
        if not self._watch(threading.get_ident(), run):
            return self._return_stopping(claimed, AFTER_GRACE)
        value, raised = self._call(handler, context, arguments, run, begin)
        if clock.abandoned:
            return False  # settled by fail_hung when it outlived its hard limit
        duration = time.monotonic() - clock.started_monotonic
        error = clock.timeout_error or raised  # the timeout wins over whatever the handler did after it
        return self._settle_outcome(claimed, task, config, value, error, raised, duration, on_settled)

    def _not_started(
        self,
        why: NotStarted,
        claimed: Claimed,
        task: Task,
        config: TaskTypeConfig,
        on_settled: Callable[[], None] | None,
    ) -> bool:
        """Settle a task whose run must not start; True if the ack batcher settles it (and calls `on_settled`)."""
        if why is NotStarted.CANCELLED:  # cancelled before it started
            return self._drop_cancelled(claimed, task, config, on_settled)
        if why is NotStarted.SUPERSEDED:  # a later claim holds it: it runs there, never here as well
            return self._ack_settled(claimed, task, None, "superseded", None, on_settled)
        return False  # its lease lapsed while the start was written: the reaper owns it now

    def _settle_outcome(
        self,
        claimed: Claimed,
        task: Task,
        config: TaskTypeConfig,
        value: Any,
        error: BaseException | None,
        raised: BaseException | None,
        duration: float,
        on_settled: Callable[[], None] | None,
    ) -> bool:
        """Settle a run that returned `value` or failed with `error`; True if the ack batcher calls `on_settled`."""
        if isinstance(error, StartMissed):  # its handler never began
            return self._start_again(claimed, task)
        metrics.of_run(task.type, task.queue).duration.observe(duration)
        if error is None:
            try:
                return_json = results.result_json(value, self.max_result_bytes)
            except (ResultNotJson, ResultTooLarge) as exc:
                error = exc
            else:
                return self._succeed(claimed, task, return_json, duration, on_settled, self._release_of(task, config))
        if isinstance(error, TaskCancelled):
            return self._end_cancelled(claimed, task, config, duration, on_settled)
        self._fail(claimed, task, config, error, failure_traceback(error, raised), duration)
        return False

    def _call(
        self, handler: Handler, context: TaskContext, arguments: Arguments, run: Running, begin: Callable[[], None]
    ) -> tuple[Any, BaseException | None]:
        """Call the handler under its run's clock (watched since `_watch`); return its value and what it raised."""
        key, clock = threading.get_ident(), run.clock
        metrics.BUSY_WORKERS.inc()
        try:
            # A child the handler forked exits as the handler returns: it must not settle the task too.
            value, raised = call_with_clock(
                clock,
                lambda: call_unforked(
                    lambda: self.invoke(handler, context, arguments, lambda: clock.timeout_error, begin)
                ),
            )
        finally:
            metrics.BUSY_WORKERS.dec()
            with self._running_lock:
                self.running.pop(key, None)
            last_progress = progress_update(run, self.result_ttl_s)
            if last_progress is not None:  # before the outcome: the batcher keeps the order
                self.watch.record(last_progress)
        return value, raised

    def invoke(
        self,
        handler: Handler,
        context: TaskContext,
        arguments: Arguments,
        timed_out: Callable[[], BaseException | None] = lambda: None,
        begin: Callable[[], None] = no_start_check,
    ) -> Any:
        """Call a handler with the task's arguments (and its context if it takes one, and as `context.current()`).

        `begin` is called just before: what it raises (StartMissed, past its rate admission's start margin)
        stops the run unstarted.
        """
        with running(context):
            if handler.django_task is not None:
                return runner.run(handler.django_task, context, arguments, self.broker, timed_out, begin)
            if handler.is_async:  # without an asyncio lane, on this thread
                return asyncio.run(self.invoke_async(handler, context, arguments, None, begin))
            begin()
            args = (context, *arguments.args) if handler.takes_context else arguments.args
            value = handler.func(*args, **arguments.kwargs)
            if inspect.iscoroutine(value):  # a plain function wrapping an async one: run it here, to its end
                return asyncio.run(value)
            return value
