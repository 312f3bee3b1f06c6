"""Running one claimed task: decode, gate, call its handler, then ack, retry or dead-letter.

Whatever goes wrong, the task is settled (dead-lettered with the reason as a last resort).
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any, NoReturn

from redis.exceptions import RedisError, ResponseError

from tasks_app import metrics, tracing, workflows
from tasks_app.consumer.ack_batcher import AckBatcher
from tasks_app.consumer.async_lane import AsyncLane, Flight, LaneSeat
from tasks_app.consumer.claiming import Claimed, PauseWatch, return_unstarted
from tasks_app.consumer.gates import Admission, ConcurrencyGate, StartMissed, check_start, key_token_of
from tasks_app.consumer.settling import Settler, retries_left
from tasks_app.consumer.time_limits import RunClock, Running, TimeLimits, call_unforked, call_with_clock, within_timeout
from tasks_app.context import TaskContext, running
from tasks_app.django_tasks import runner
from tasks_app.exceptions import ResultNotJson, ResultTooLarge, TaskCancelled
from tasks_app.protocol import records
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Arguments, Task, UndecodableTask, decode_payload, decode_task
from tasks_app.protocol.keys import delayed_member
from tasks_app.protocol.limits import SlotSet
from tasks_app.protocol.records import now_ms
from tasks_app.registry import Handler, Registry
from tasks_app.task_types import TaskTypeCache, TaskTypeConfig

logger = logging.getLogger("tasks_app.tasks")

# A task of a disabled type waits this long (enabling the type wakes it at once), its note a while longer.
DISABLED_RECHECK_MS = 300_000
# A task whose type's settings could not be read (the database away) is looked at again this soon.
SETTINGS_RECHECK_MS = 5000
DISABLED_NOTE_TTL_MS = 2 * DISABLED_RECHECK_MS
SETTINGS_UNKNOWN = "the task types cannot be read"
# A task still passing its gates as a stop's grace period ends goes back unstarted: the exiting process would
# abandon its run.
AFTER_GRACE = "passed its gates only after the grace period of the stop ended"
INT32_MAX = 2**31 - 1  # the envelope's attempt field

# Admits a task, or says how many ms it waits (the third argument: its `rate_limit_key` value's token).
RateGate = Callable[[Task, TaskTypeConfig, str | None], Admission]


class NotStarted(enum.Enum):
    """Why a claimed task's run must not start."""

    CANCELLED = "cancelled"  # its record says it was cancelled before it started
    SUPERSEDED = "superseded"  # a later claim's token is on the record: that claim runs it
    LEASE_LOST = "lease lost"  # the lease lapsed while the start was written: the reaper owns it


class Executor:
    """Runs claimed tasks on worker threads (or the asyncio lane) and has them settled in Redis."""

    def __init__(
        self,
        broker: Broker,
        registry: Registry,
        task_types: TaskTypeCache,
        worker_id: str,
        result_ttl_s: int,
        *,
        rate_gate: RateGate | None = None,
        acks: AckBatcher,
        async_lane: AsyncLane,
        give_up: threading.Event | None = None,
        concurrency: ConcurrencyGate | None = None,
        lease_check: Callable[[Claimed], bool] | None = None,
        trace_links: bool = False,
    ) -> None:
        give_up = give_up or threading.Event()
        self.broker = broker
        self.registry = registry
        self.task_types = task_types
        self.worker_id = worker_id
        self.result_ttl_s = result_ttl_s
        self.settler = Settler(broker, registry, task_types, result_ttl_s, acks=acks, give_up=give_up)
        self.time_limits = TimeLimits(self.settler)
        self.pauses = PauseWatch(broker, give_up, result_ttl_s)
        self.rate_gate = rate_gate
        self.concurrency = concurrency
        self.async_lane = async_lane
        self.lease_check = lease_check  # waits while the claim's lease may have lapsed; False once lost
        self.trace_links = trace_links  # a run's span links to its send span instead of being its child

    def execute(self, claimed: Claimed, on_settled: Callable[[], None] | None = None) -> bool:
        """Run a claimed task to its end (unless paused since its claim); True if the ack batcher settles it."""
        return self.settler.last_resort(
            claimed, lambda: not self.pauses.return_if_paused(claimed) and self._execute(claimed, on_settled)
        )

    def _execute(self, claimed: Claimed, on_settled: Callable[[], None] | None) -> bool:
        settler = self.settler
        try:
            task = claimed.task if claimed.task is not None else decode_task(claimed.raw)
        except UndecodableTask as exc:
            settler.dead_letter_undecodable(claimed, str(exc))
            return False
        if task.queue != claimed.queue:  # an envelope's empty or other queue: where it was claimed wins
            task.queue = claimed.queue
        config, problem = self._resolve(task, claimed.claimed_at_s)
        if claimed.receipt == records.START_REFUSED:  # cancelled before its claim: dropped, whatever its type
            return settler.cancelled(claimed, task, config, on_settled)
        if problem == SETTINGS_UNKNOWN:  # neither run with defaults its row may change nor dead-lettered as unknown
            settler.defer(claimed, task, SETTINGS_RECHECK_MS, "settings_unknown")
            return False
        if config is None:
            settler.dead_letter(claimed, task, "UnknownTaskType", problem)
            return False
        # A TaskType row may name a `@django.tasks.task` function this process has not imported yet.
        handler = self.registry.get(config.handler) or self.registry.load_django_task(config.handler)
        if handler is None:
            reason = f"handler {config.handler!r} of task type {task.type!r} is not registered"
            if self.registry.import_errors:
                reason += f" (handler modules that failed to import: {self.registry.import_errors})"
            settler.dead_letter(claimed, task, "HandlerNotRegistered", reason, config)
            return False
        if not config.enabled:
            settler.defer(claimed, task, DISABLED_RECHECK_MS, "disabled")
            try:  # to be woken when the type is enabled
                self.broker.limits.note_disabled(
                    claimed.queue, task.type, task.priority, claimed.raw, DISABLED_NOTE_TTL_MS
                )
            except RedisError as exc:  # it comes back at its recheck instead
                logger.debug("could not note a task of disabled type %s for its wake-up: %s", task.type, exc)
            return False
        try:
            arguments = decode_payload(task.payload)
        except UndecodableTask as exc:
            settler.dead_letter(claimed, task, "InvalidPayload", str(exc), config)
            return False
        if (dropped := settler.drop_if_cancelled_while_held(claimed, task, config, on_settled)) is not None:
            return dropped  # before its gates: a task cancelled while it waited takes no rate or permit
        seat = None
        if handler.is_async:  # a seat before the gates: a rate admission is spent only if the run can begin at once
            seat = self.async_lane.reserve()
            if seat is None:
                return self._return_stopping(claimed, "waited for room on the asyncio lane")
        try:
            release = self._admit(claimed, task, config, arguments)
            if release is None:
                return False
            if seat is not None:  # a run on the lane holds its permit until it is settled
                on_settled = partial(self._settled, release, on_settled)
            later = False
            try:
                later = self._run(claimed, task, config, handler, arguments, on_settled, seat)
            finally:
                if seat is None or not later:
                    release()
            return later
        finally:
            if seat is not None:
                seat.give_back()  # unless its run took it

    def _settled(self, release: Callable[[], None], on_settled: Callable[[], None] | None) -> None:
        """Release the permit of a lane's run once it is settled (not a hung one's: it lapses), then `on_settled`."""
        if not self.settler.retry_floor_s:
            release()
        if on_settled is not None:
            on_settled()

    def _resolve(self, task: Task, claimed_at_s: float) -> tuple[TaskTypeConfig | None, str]:
        """The task's settings; else None and why (SETTINGS_UNKNOWN: ask again later)."""
        config = self.task_types.get(task.type)
        needs_rows = config is None and (self.registry.get(task.type) is None or not self.task_types.loaded)
        if needs_rows:  # a row created since the last refresh: read once after the claim holds it
            if not self.task_types.holds_rows_since(claimed_at_s):
                return None, SETTINGS_UNKNOWN
            config = self.task_types.get(task.type)
        if config is not None:
            return config, ""
        if self.registry.get(task.type) is not None:
            return TaskTypeConfig.default_for(task.type), ""
        return None, f"unknown task type {task.type!r}: no TaskType row and no handler of that name"

    def _admit(
        self, claimed: Claimed, task: Task, config: TaskTypeConfig, arguments: Arguments
    ) -> Callable[[], None] | None:
        """Pass the rate limit, then take a concurrency permit; None: deferred, else what releases the permit."""
        if config.rate_limit and self.rate_gate is not None:
            key_token = key_token_of(config.rate_limit_key, arguments)
            admission = self.rate_gate(task, config, key_token)
            if admission.wait_ms > 0:
                self.settler.defer(claimed, task, admission.wait_ms, "rate_limited")
                self._due_at_its_turn(claimed, task, key_token)
                return None
            claimed.start_by = admission.start_by  # its handler begins by then, or it waits again
        gate = self.concurrency
        if not config.max_running or gate is None:
            return _nothing
        permits = SlotSet(config.name, key_token_of(config.max_running_key, arguments), int(config.max_running or 0))
        holder = gate.acquire(claimed, task, permits)
        if holder is None:
            self.settler.defer(claimed, task, gate.recheck_ms(), "max_running")
            gate.wait(claimed, task, permits)
            return None
        return partial(gate.release, holder)

    def _due_at_its_turn(self, claimed: Claimed, task: Task, key_token: str | None) -> None:
        """Bring a task the rate limit just deferred to its turn as its limiter holds it now (gone: due now).

        A follow-up of a limit changed since the denial may have scanned the delayed set before it landed.
        """
        try:
            due_us, now_us = self.settler.redis(
                lambda: self.broker.limits.rate_deferred(task.type, key_token, task.id, claimed.queue), "defer"
            )
        except ResponseError as exc:  # a misconfigured limiter key: the task keeps the turn it was given
            logger.warning("could not check the rate limit turn of deferred task %s: %s", task.id, exc)
            return
        current = self.task_types.get(task.type)  # read after: a refresh before that call is seen here
        gone = current is None or not current.rate_limit or due_us <= now_us
        due_ms = now_us // 1000 if gone else math.ceil(due_us / 1000)
        member = delayed_member(task.priority, claimed.raw)
        self.settler.redis(lambda: self.broker.limits.bring_forward(claimed.queue, {member: due_ms}), "defer")

    def _record_start(
        self, claimed: Claimed, task: Task, config: TaskTypeConfig, handler: Handler, arguments: Arguments
    ) -> int | NotStarted:
        """Count the attempt and record its start; return the task's attempt limit, or why it must not start."""
        if claimed.receipt == records.SUPERSEDED:
            return NotStarted.SUPERSEDED
        task.attempt = min(max(task.attempt, 0) + 1, INT32_MAX)  # below 0 reads as 0; int32's end stays there
        max_attempts = task.max_attempts or config.max_attempts
        started_ms = now_ms()
        started_update = records.started(
            task,
            arguments,
            self.worker_id,
            started_ms,
            max_attempts,
            self.result_ttl_s,
            claimed.fence,
            record_exists=claimed.receipt == records.RECEIPT_OF_RECORD,
        )
        if handler.django_task is not None:  # a @task function reads its own record
            reply = self.settler.redis(lambda: self.broker.records.record_result(started_update), "record_result")
        elif claimed.receipt is not None:  # the receipt decided: it goes out with the next flush
            self.settler.acks.record(started_update)
            reply = None
        else:  # shares a flush with other workers' writes
            reply = self.settler.acks.record_start(started_update)
        if reply == records.START_REFUSED:
            return NotStarted.CANCELLED
        if reply == records.SUPERSEDED:
            return NotStarted.SUPERSEDED
        # The write may have waited for Redis: a lease lost since is the reaper's, this record fenced off.
        if self.lease_check is not None and not self.lease_check(claimed):
            return NotStarted.LEASE_LOST
        # A suspect's start is durable before its handler runs: a death from now on is the task's fault.
        if claimed.suspect and not self.settler.redis(
            lambda: self.broker.queue.mark_started(claimed.queue, claimed.consumer_id, claimed.raw), "mark_started"
        ):
            return NotStarted.LEASE_LOST
        if claimed.start_by == math.inf:  # else counted as its handler begins (`_begin_admitted`), if it does
            _count_start(task, started_ms)
        return max_attempts

    def _return_stopping(self, claimed: Claimed, waited: str) -> bool:
        """Put back unstarted a task that `waited` until the consumer stopped: it must not start now (False)."""
        return_unstarted(self.broker, [claimed], self.result_ttl_s, self.pauses.give_up)
        logger.info("stopping: a task that %s went back to pending unstarted", waited)
        return False

    def _run(
        self,
        claimed: Claimed,
        task: Task,
        config: TaskTypeConfig,
        handler: Handler,
        arguments: Arguments,
        on_settled: Callable[[], None] | None,
        seat: LaneSeat | None,
    ) -> bool:
        """Start a task that passed its gates: on the asyncio lane in `seat` if given, else on this thread."""
        if self.time_limits.starts_closed:  # most such tasks are met here, before their start is written
            return self._return_stopping(claimed, AFTER_GRACE)
        if self.lease_check is not None and not self.lease_check(claimed):
            return False  # its lease was lost while it passed the gates: the reaper owns it now
        max_attempts = self._record_start(claimed, task, config, handler, arguments)
        if max_attempts is NotStarted.CANCELLED:
            return self.settler.cancelled(claimed, task, config, on_settled)
        if max_attempts is NotStarted.SUPERSEDED:  # a later claim holds it: it runs there, never here as well
            return self.settler.ack_settled(claimed, task, None, "superseded", None, on_settled)
        if isinstance(max_attempts, NotStarted):
            return False  # its lease lapsed while the start was written: the reaper owns it now
        context = TaskContext(
            task.id, task.type, task.queue, task.attempt, max_attempts, dict(task.headers), claimed.consumer_id
        )
        # A rate admission's start is checked, and counted, as its handler begins (see _record_start).
        begin = partial(_begin_admitted, task, claimed.start_by) if claimed.start_by != math.inf else _nothing
        timeout_s = config.timeout_s or None
        clock = RunClock(timeout_s)  # a lane's run is timed out on its loop: its clock only keeps the books
        run = Running(task, clock, context, claimed, config, clock.force_cancel)
        if seat is not None:
            flight = Flight(partial(self._settle_lane_run, run), clock)
            run.force_stop, run.settle_given_up = flight.cancel, partial(flight.settle_off_loop, None)
        if not self.time_limits.begin(run):
            return self._return_stopping(claimed, AFTER_GRACE)
        run.span = span = tracing.start_run(
            task.headers, task.id, task.type, task.queue, task.attempt, claimed.consumer_id, self.trace_links
        )
        if seat is not None:  # the lane settles it, and calls `on_settled` then
            coroutine = self._coroutine(handler, context, arguments, timeout_s, begin, span)
            seat.lane.submit(coroutine, flight, on_settled or _nothing, seat)
            return True
        metrics.BUSY_WORKERS.inc()
        try:
            call = partial(self.invoke, handler, context, arguments, lambda: clock.timeout_error, begin)
            with tracing.current(span):  # the handler's own spans nest under the run's
                value, raised = call_with_clock(clock, partial(call_unforked, call))
        finally:
            metrics.BUSY_WORKERS.dec()
            self.time_limits.end(context.control)
        if clock.abandoned:  # settled by the time limits when it outlived its hard limit
            tracing.end_run(span, tracing.ABANDONED, clock.timeout_error or clock.cancel_error)
            return False
        duration = time.monotonic() - clock.started_monotonic
        # The timeout wins over whatever the handler did after it; a value that cannot be stored fails the run.
        return_json, error = self.settler.stored(value, clock.timeout_error or raised)
        try:
            return self.settler.settle_outcome(claimed, task, config, return_json, error, raised, duration, on_settled)
        finally:
            tracing.end_run(span, _outcome(error, context), error)

    def invoke(
        self,
        handler: Handler,
        context: TaskContext,
        arguments: Arguments,
        timed_out: Callable[[], BaseException | None],
        begin: Callable[[], None],
    ) -> Any:
        """Call a handler with the task's arguments (and its context if it takes one, and as `context.current()`)."""
        with running(context):
            if handler.django_task is not None:
                return runner.run(handler.django_task, context, arguments, self.broker.records, timed_out, begin)
            begin()
            args = (context, *arguments.args) if handler.takes_context else arguments.args
            value = handler.func(*args, **arguments.kwargs)
            if inspect.iscoroutine(value):  # a plain function wrapping an async one: run it here, to its end
                return asyncio.run(value)
            return value

    def _coroutine(
        self,
        handler: Handler,
        context: TaskContext,
        arguments: Arguments,
        timeout_s: float | None,
        begin: Callable[[], None],
        span: tracing.RunSpan | None = None,
    ) -> Coroutine[Any, Any, Any]:
        """The coroutine of an `async def` handler's run, cancelled with TaskTimeout at `timeout_s`."""
        # The handler's coroutine is made only as it begins: one closed before leaves none unawaited.
        start: Callable[[], Awaitable[Any]]
        if handler.django_task is None:

            async def start() -> Any:
                begin()
                args = (context, *arguments.args) if handler.takes_context else arguments.args
                return await within_timeout(handler.func(*args, **arguments.kwargs), timeout_s)

        else:
            try:
                with running(context):  # task_started, sent now, sees the run as current
                    start = runner.start_async(
                        handler.django_task, context, arguments, self.broker.records, timeout_s, begin
                    )
            except BaseException as exc:  # as call_with_clock catches a sync handler's
                start = partial(_raising, exc)
        return as_current(context, start, span)

    def _settle_lane_run(
        self,
        run: Running,
        value: Any,
        raised: BaseException | None,
        duration: float,
        on_settled: Callable[[], None],
        on_loop: bool,
    ) -> bool:
        """Settle a lane's run; on the loop, only a success the batcher takes without waiting (else False)."""
        claimed, task, config, control = run.claimed, run.task, run.config, run.context.control
        if on_loop and workflows.is_member(task.headers):
            return False  # recording its end in its workflow waits on Redis: not on the loop
        if on_loop:
            try:
                return_json = records.result_json(value, self.settler.max_result_bytes)
            except (ResultNotJson, ResultTooLarge):
                return False
            self.time_limits.end(control)  # the batcher only queues its progress write, before the ack
            metrics.of_run(task.type, task.queue).duration.observe(duration)
            try:
                return self.settler.succeed(claimed, task, return_json, duration, on_settled, config)
            finally:
                tracing.end_run(run.span, tracing.SUCCEEDED, None)

        def settle() -> bool:
            self.time_limits.end(control)
            return_json, error = self.settler.stored(value, raised)
            try:
                return self.settler.settle_outcome(
                    claimed, task, config, return_json, error, raised, duration, on_settled
                )
            finally:
                tracing.end_run(run.span, _outcome(error, run.context), error)

        return self.settler.last_resort(claimed, settle)


def _nothing() -> None:
    """No permit to release, no start to check (no rate limit admitted the run), no one to tell."""


async def _raising(error: BaseException) -> NoReturn:
    raise error


async def as_current[T](
    context: TaskContext, start: Callable[[], Awaitable[T]], span: tracing.RunSpan | None = None
) -> T:
    """Await what `start()` returns, with `context` and `span` current."""
    with running(context), tracing.current(span):
        return await start()


def _outcome(error: BaseException | None, context: TaskContext) -> str:
    """What a run that ended with `error` comes to, as its span says."""
    if error is None:
        return tracing.SUCCEEDED
    if isinstance(error, TaskCancelled):
        return tracing.CANCELLED
    if isinstance(error, StartMissed):  # its handler never began: sent back to wait
        return tracing.DEFERRED
    return tracing.RETRIED if retries_left(error, context.attempt, context.max_attempts) else tracing.DEAD_LETTERED


def _begin_admitted(task: Task, start_by: float) -> None:
    """Let the handler of a task its rate limit admitted begin, counting its start; StartMissed past `start_by`."""
    check_start(start_by)
    _count_start(task, now_ms())


def _count_start(task: Task, started_ms: float) -> None:
    """The metrics of a run that starts now: one more start, and how long a first run waited."""
    run_metrics = metrics.of_run(task.type, task.queue)
    run_metrics.started.inc()
    waited_since_ms = task.run_after_ms or task.enqueued_at_ms
    if waited_since_ms and task.attempt == 1:
        run_metrics.wait.observe(max(0.0, (started_ms - waited_since_ms) / 1000))
