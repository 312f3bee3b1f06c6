"""What bounds a running handler, and what watches it: its time limits, cancels, progress, and forks it made.

Timeouts and forced cancels are raised inside the run's own thread; the run stays held until the
handler returns, so a retry never overlaps it. In process mode a run that outlives that by a grace
period is abandoned and its process replaced. A child a handler forked exits as the handler returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NoReturn

from tasks_app.consumer.claiming import Claimed
from tasks_app.consumer.settling import CANCEL_CHECK_S, Settler, log_fields
from tasks_app.context import RunControl, TaskContext
from tasks_app.exceptions import TaskCancelled, TaskInterrupted, TaskTimeout
from tasks_app.protocol.codec import Task, compact_json
from tasks_app.protocol.history import CancelMark
from tasks_app.protocol.records import ResultUpdate
from tasks_app.task_types import TaskTypeConfig
from tasks_app.tracing import RunSpan

logger = logging.getLogger("tasks_app.tasks")

PROGRESS_EVERY_S = 0.25


def _set_async_exc(thread_id: int, exc_type: type[BaseException] | None) -> None:
    """Raise `exc_type` in a thread at its next bytecode; None clears one not yet delivered."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc_type) if exc_type is not None else ctypes.c_void_p(0)
    )


@dataclass
class RunClock:
    """One run's deadline, and the right to interrupt its thread until it has returned."""

    timeout_s: float | None
    thread_id: int = field(default_factory=threading.get_ident)
    started_monotonic: float = field(default_factory=time.monotonic)
    timeout_error: TaskTimeout | None = None  # once raised in the handler's thread
    cancel_error: TaskCancelled | None = None  # a forced cancel, once raised there
    interrupted_monotonic: float = 0.0  # when either was
    returned: bool = False
    abandoned: bool = False  # settled while its handler still ran (a hard limit or a stop)
    armed: bool = False  # an exception raised in the thread is sure to be caught by call_with_clock
    lock: threading.Lock = field(default_factory=threading.Lock)

    def overdue(self, now_monotonic: float) -> bool:
        """True if the run is past its deadline and has not been interrupted or returned."""
        return (
            self.timeout_s is not None
            and now_monotonic - self.started_monotonic >= self.timeout_s
            and self.timeout_error is None
            and self.cancel_error is None
            and not self.returned
        )

    def interrupt(self) -> bool:
        """Raise TaskTimeout in the run's thread, once, unless the handler already returned (or was cancelled)."""
        return self._raise_in_thread(TaskTimeout(f"task exceeded its timeout of {self.timeout_s:g} s"))

    def force_cancel(self) -> bool:
        """Raise TaskCancelled in the run's thread, once, unless the handler already returned (or timed out)."""
        return self._raise_in_thread(TaskCancelled("the task was cancelled with force"))

    def _raise_in_thread(self, error: TaskTimeout | TaskCancelled) -> bool:
        with self.lock:
            if self.returned or self.timeout_error is not None or self.cancel_error is not None:
                return False
            self.interrupted_monotonic = time.monotonic()
            if isinstance(error, TaskTimeout):
                self.timeout_error = error
            else:
                self.cancel_error = error
            if self.armed:
                _set_async_exc(self.thread_id, type(error))
            return True

    def abandon(self, grace_s: float, now_monotonic: float) -> bool:
        """Give up on a run still going `grace_s` after its timeout or forced cancel; True once, if it did."""
        with self.lock:
            if self.returned or self.abandoned:
                return False
            if self.cancel_error is not None:
                self.abandoned = now_monotonic - self.interrupted_monotonic >= grace_s
            elif self.timeout_error is not None and self.timeout_s is not None:
                self.abandoned = now_monotonic - self.started_monotonic >= self.timeout_s + grace_s
            return self.abandoned

    def give_up(self) -> bool:
        """Give up on a run still going as its consumer leaves (past the grace period); True once, if it did."""
        with self.lock:
            if self.returned or self.abandoned:
                return False
            self.abandoned = True
            return True

    def finish(self) -> bool:
        """Mark the handler returned (by its own thread): no interrupt arrives after; True unless settled already."""
        with self.lock:
            if self.returned:
                return False
            self.returned = True
            if self.armed and (self.timeout_error is not None or self.cancel_error is not None):
                _set_async_exc(self.thread_id, None)
            return not self.abandoned


def call_with_clock(clock: RunClock, call: Callable[[], object]) -> tuple[object, BaseException | None]:
    """Run `call` under `clock`; return its value and what it raised."""
    value: object = None
    raised: BaseException | None = None
    returned_at: float | None = None
    try:
        try:
            with clock.lock:
                clock.armed = True
                early = clock.timeout_error or clock.cancel_error  # raised before the run could catch it
            if early is not None:
                raise early
            value = call()
            returned_at = time.monotonic()
        except BaseException as exc:  # a handler's sys.exit() must not kill the worker thread
            raised = exc
        finally:
            clock.finish()
    except (TaskTimeout, TaskCancelled) as late:  # delivered after the call ended, before finish() took the lock
        raised = raised or late
        clock.finish()
    if returned_at is not None and clock.interrupted_monotonic > returned_at:
        with clock.lock:  # the run had ended: reporting it cancelled (or retrying it) would be wrong
            clock.timeout_error = clock.cancel_error = None
        return value, None
    if clock.cancel_error is not None:
        return None, clock.cancel_error
    return value, raised


async def within_timeout[T](awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """Await `awaitable`, cancelling it at `timeout_s` with TaskTimeout (its `finally` blocks run)."""
    async with asyncio.timeout(timeout_s) as scope:
        try:
            value = await awaitable
        except asyncio.CancelledError:
            if scope.expired():
                raise TaskTimeout(f"task exceeded its timeout of {timeout_s:g} s") from None
            raise
    deadline = scope.when()
    if scope.expired() or (deadline is not None and asyncio.get_running_loop().time() >= deadline):
        raise TaskTimeout(f"task exceeded its timeout of {timeout_s:g} s")
    return value


@dataclass(slots=True)  # not frozen: one per run, and frozen costs four times as much to build
class Running:
    """A task whose handler is running, watched for its timeout, cancel requests and progress."""

    task: Task
    clock: RunClock
    context: TaskContext
    # What a hard limit needs to settle the run from another thread (process mode).
    claimed: Claimed
    config: TaskTypeConfig
    force_stop: Callable[[], object]  # raises TaskCancelled where it runs (its thread, or the lane's loop)
    # A run on the asyncio lane: how it is settled once given up on (else by the settler, from here).
    settle_given_up: Callable[[BaseException | None, float], None] | None = None
    span: RunSpan | None = None  # its `process` span, ended once it is settled


class TimeLimits:
    """The runs of an executor being watched: their time limits, forced cancels, cancel requests and progress."""

    def __init__(self, settler: Settler) -> None:
        self.settler = settler
        self.running: dict[RunControl, Running] = {}
        self._lock = threading.Lock()
        self.starts_closed = False  # set (under the lock) when a stop's grace period ends: no run starts after
        self._hung_settlers: list[threading.Thread] = []
        self._checked_at = self._progress_at = float("-inf")

    def begin(self, run: Running) -> bool:
        """Watch `run` as it starts; False if it must not start: a stop's grace period ended (see interrupt_running)."""
        with self._lock:
            if self.starts_closed:
                return False
            self.running[run.context.control] = run
            return True

    def end(self, control: RunControl) -> None:
        """Stop watching a run that ended; write the progress it set since the last tick (before its outcome)."""
        with self._lock:
            run = self.running.pop(control, None)
        if run is not None:
            self._write_progress(run)

    def _write_progress(self, run: Running) -> None:
        progress = run.context.control.take_progress()
        if progress is not None:
            task, ttl_s = run.task, self.settler.result_ttl_s
            fields = {"progress": compact_json(progress)}
            self.settler.acks.record(
                ResultUpdate(task.id, fields, ttl_s, fence=run.claimed.fence, queue=task.queue, task_type=task.type)
            )

    def tick(self) -> None:
        """Write due progress, and every CANCEL_CHECK_S tell the runs whose task someone cancelled."""
        with self._lock:
            runs = list(self.running.values())
        now = time.monotonic()
        if now - self._progress_at >= PROGRESS_EVERY_S:
            self._progress_at = now
            for run in runs:
                self._write_progress(run)
        if not runs or now - self._checked_at < CANCEL_CHECK_S:
            return
        self._checked_at = now
        by_queue: dict[str, list[Running]] = {}
        for run in runs:
            if not run.context.control.forced:
                by_queue.setdefault(run.task.queue, []).append(run)
        for queue, queue_runs in by_queue.items():
            marks = self.settler.broker.control.cancel_marks(queue, [run.task.id for run in queue_runs])
            for run, mark in zip(queue_runs, marks, strict=True):
                control = run.context.control
                if mark == CancelMark.FORCED:  # the flag it polls, and TaskCancelled raised where it runs
                    control.force()
                    run.force_stop()
                    logger.warning(
                        "task %s was cancelled with force while running: TaskCancelled raised in it", run.task.id
                    )
                elif mark == CancelMark.REQUESTED and not control.cancelled:
                    control.cancel()
                    logger.info("task %s was cancelled while running; its handler is told", run.task.id)

    def expire_overdue(self) -> int:
        """Raise TaskTimeout in every run past its timeout; each is settled once its handler returns."""
        now = time.monotonic()
        with self._lock:
            overdue = [run for run in self.running.values() if run.clock.overdue(now)]
        interrupted = 0
        for run in overdue:
            if run.clock.interrupt():
                interrupted += 1
                message = (
                    "task %s exceeded its timeout of %g s: TaskTimeout raised in its handler; "
                    "it stays held until the handler returns"
                )
                logger.warning(message, run.task.id, run.clock.timeout_s, extra=log_fields(run.task, "timed_out"))
        return interrupted

    def fail_hung(self, grace_s: float, exit_within_s: float) -> int:
        """Give up on every run still going `grace_s` after its TaskTimeout (failed) or forced cancel (cancelled)."""
        # Process mode only: no retry is due before the process is gone; the fence voids a late outcome.
        now = time.monotonic()
        with self._lock:
            runs = [run for run in self.running.values() if run.clock.abandon(grace_s, now)]
        for run in runs:
            forced = run.clock.cancel_error is not None
            logger.error(
                "task %s still running %g s %s, and its process will be replaced",
                run.task.id,
                grace_s,
                "after a forced cancel: cancelled" if forced else "past its timeout: failed",
                extra=log_fields(run.task, "cancelled" if forced else "hung"),
            )
        return self._settle_apart(runs, None, exit_within_s)

    def interrupt_running(self, grace_s: float, exit_within_s: float) -> int:
        """Give up on every run still going at the end of a stop's grace period (`grace_s`); how many."""
        with self._lock:
            self.starts_closed = True  # a worker still passing its gates must not start its run after this
            runs = [run for run in self.running.values() if run.clock.give_up()]
        error = TaskInterrupted(f"the consumer stopped, and the run still went on {grace_s:g} s after the stop")
        return self._settle_apart(runs, error, exit_within_s)

    def wait_hung_settled(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the runs given up on to be settled (before their tasks could be returned)."""
        deadline = time.monotonic() + timeout_s
        for settler in self._hung_settlers:
            settler.join(max(0.0, deadline - time.monotonic()))

    def hung(self) -> int:
        """How many runs were given up by `fail_hung` and have not returned."""
        with self._lock:
            return sum(1 for run in self.running.values() if run.clock.abandoned)

    def _settle_apart(self, runs: list[Running], error: BaseException | None, exit_within_s: float) -> int:
        """Settle runs given up on, on a thread of its own; how many. No retry is due before this process is gone."""
        if not runs:
            return 0
        self.settler.retry_floor_s = max(self.settler.retry_floor_s, exit_within_s)

        def settle() -> None:
            now = time.monotonic()
            for run in runs:
                clock = run.clock
                due, duration_s = clock.cancel_error or clock.timeout_error or error, now - clock.started_monotonic
                if run.settle_given_up is not None:
                    run.settle_given_up(due, duration_s)
                    continue
                try:
                    self._write_progress(run)
                    self.settler.settle_outcome(run.claimed, run.task, run.config, None, due, None, duration_s, None)
                except Exception:  # its lease recovers it once the process is gone
                    logger.exception("could not settle task %s, given up on", run.task.id)

        thread = threading.Thread(target=settle, name="hard-limits", daemon=True)
        self._hung_settlers.append(thread)
        thread.start()
        return len(runs)


# EX_SOFTWARE: the handler that forked returned into the consumer, a bug of the handler.
FORKED_CHILD_EXIT = 70

# The lanes' loops by the thread running them, for the hook a child runs right after its fork.
_loops: dict[int, asyncio.AbstractEventLoop] = {}
_lock = threading.Lock()
_hooked = False


def call_unforked[T](call: Callable[[], T]) -> T:
    """Return `call()`; a child forked inside it exits there instead of returning (or raising)."""
    pid = os.getpid()
    try:
        return call()
    finally:
        exit_if_forked(pid)


def exit_if_forked(pid: int) -> None:
    """End this process at once unless it is `pid`: it is a child a handler forked, back in the consumer."""
    if os.getpid() != pid:
        _exit()


def guard_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Make a child forked on this thread (which runs `loop`) exit once `loop` gets control back."""
    global _hooked
    with _lock:
        if not _hooked:
            os.register_at_fork(after_in_child=_forked)
            _hooked = True
        _loops[threading.get_ident()] = loop


def unguard_loop() -> None:
    """Forget this thread's loop (the thread is about to end)."""
    with _lock:
        _loops.pop(threading.get_ident(), None)


def _forked() -> None:
    """In a child, right after its fork: if it was forked on a lane's loop, end it at the loop's next turn."""
    loop = _loops.get(threading.get_ident())  # no lock: another thread may have held it, and is gone here
    if loop is not None:
        with contextlib.suppress(RuntimeError):  # a closed loop runs nothing: its handler returns into the lane
            loop.call_soon(_exit)


def _exit() -> NoReturn:
    with contextlib.suppress(OSError):  # stderr may be closed: the exit matters, not the line
        os.write(2, f"process {os.getpid()}, forked by a handler, returned into the consumer: it exits\n".encode())
    os._exit(FORKED_CHILD_EXIT)
