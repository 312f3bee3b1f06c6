"""Soft time limits and forced cancels: TaskTimeout or TaskCancelled raised inside the run's own thread.

CPython delivers such an exception between two bytecodes of the target thread: pure-Python code
stops at once (its `finally` blocks and context managers run), a C call (time.sleep, a socket
read) finishes first. The run stays held by its worker until the handler returns; only then is
it settled, so a retry never overlaps it. (In process mode a run that outlives the exception by
a grace period is abandoned, and its process replaced: see `RunClock.abandon`.)
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tasks_app.exceptions import TaskCancelled, TaskTimeout


def _set_async_exc(thread_id: int, exc_type: type[BaseException] | None) -> None:
    # None clears an exception not yet delivered (the run returned in the meantime).
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc_type) if exc_type is not None else ctypes.c_void_p(0)
    )


@dataclass
class RunClock:
    """One run's deadline, and the right to interrupt its thread until it has returned."""

    timeout_s: float | None
    thread_id: int = field(default_factory=threading.get_ident)
    started_monotonic: float = field(default_factory=time.monotonic)
    # The timeout, once the watchdog raised it in the handler's thread.
    timeout_error: TaskTimeout | None = None
    # A forced cancel, once raised in the handler's thread, and when (monotonic).
    cancel_error: TaskCancelled | None = None
    forced_monotonic: float = 0.0
    # When the timeout or the forced cancel was raised in the thread (monotonic).
    interrupted_monotonic: float = 0.0
    returned: bool = False
    # Settled while its handler still ran (a hard limit or a forced cancel in process mode, or a stop).
    abandoned: bool = False
    # Set by call_with_clock once an exception raised in the thread is sure to be caught there.
    armed: bool = False
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
        with self.lock:
            if self.returned or self.timeout_error is not None or self.cancel_error is not None:
                return False
            self.timeout_error = TaskTimeout(f"task exceeded its timeout of {self.timeout_s:g} s")
            self.interrupted_monotonic = time.monotonic()
            if self.armed:
                _set_async_exc(self.thread_id, TaskTimeout)
            return True

    def force_cancel(self) -> bool:
        """Raise TaskCancelled in the run's thread, once, unless the handler already returned (or timed out)."""
        with self.lock:
            if self.returned or self.timeout_error is not None or self.cancel_error is not None:
                return False
            self.cancel_error = TaskCancelled("the task was cancelled with force")
            self.forced_monotonic = self.interrupted_monotonic = time.monotonic()
            if self.armed:
                _set_async_exc(self.thread_id, TaskCancelled)
            return True

    def abandon(self, grace_s: float, now_monotonic: float) -> bool:
        """Give up on a run still going `grace_s` after its timeout or forced cancel; True once, if it did."""
        with self.lock:
            if self.returned or self.abandoned:
                return False
            if self.cancel_error is not None:
                self.abandoned = now_monotonic - self.forced_monotonic >= grace_s
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

    def finish(self) -> None:
        """Mark the handler returned (called by its own thread): no interrupt may arrive after this."""
        with self.lock:
            if self.returned:
                return
            self.returned = True
            if self.armed and (self.timeout_error is not None or self.cancel_error is not None):
                _set_async_exc(self.thread_id, None)

    def pardon(self) -> None:
        """Forget a timeout or forced cancel that came after the handler had returned (its value stands)."""
        with self.lock:
            self.timeout_error = self.cancel_error = None


def call_with_clock(clock: RunClock, call: Callable[[], object]) -> tuple[object, BaseException | None]:
    """Run `call` under `clock`; return its value and what it raised.

    A forced cancel wins over whatever the handler did after it (a return, another exception); one
    (or a timeout) that comes only once the handler has returned, before `finish`, changes nothing.
    """
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
        clock.pardon()  # the run had ended: reporting it cancelled (or retrying it) would be wrong
        return value, None
    if clock.cancel_error is not None:
        return None, clock.cancel_error
    return value, raised


async def within_timeout[T](awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """Await `awaitable`, cancelling it at `timeout_s` with TaskTimeout (its `finally` blocks run).

    A run that swallowed the cancellation, or blocked the loop past its deadline, still fails for
    its timeout, as a sync handler that catches TaskTimeout does.
    """
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


def failure_traceback(error: BaseException, raised: BaseException | None) -> str:
    """The traceback of a failed run: of `error`, and of what the handler raised if that differs (a timeout)."""
    text = _formatted(error)
    if raised is not None and raised is not error:
        text += "\nThe handler, interrupted at its timeout, raised:\n" + _formatted(raised)
    return text


def _formatted(error: BaseException) -> str:
    """`error`'s traceback as text, or a line saying it cannot be shown (its own code raised while formatted)."""
    try:
        return "".join(traceback.format_exception(error))
    except BaseException:  # traceback shields from an Exception in __str__, not from SystemExit and its kin
        return f"{type(error).__qualname__} (its traceback cannot be shown: formatting it raised)\n"
