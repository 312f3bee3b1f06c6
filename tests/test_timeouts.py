"""Soft limits and forced cancels: TaskTimeout or TaskCancelled raised in a handler's thread, never once it returned."""

import asyncio
import threading
import time

import pytest

from tasks_app.consumer.time_limits import RunClock, call_with_clock, within_timeout
from tasks_app.exceptions import TaskCancelled, TaskTimeout


def spin(seconds: float) -> None:
    """Busy pure-Python code (no C call to finish first) for `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass


def run_in_thread(timeout_s: float, handler) -> tuple[RunClock, list]:
    clocks: list[RunClock] = []
    outcome: list = []
    ready = threading.Event()

    def target() -> None:
        clock = RunClock(timeout_s)
        clocks.append(clock)
        ready.set()
        outcome.append(call_with_clock(clock, handler))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    ready.wait(5)
    return clocks[0], outcome, thread


def test_an_overdue_pure_python_handler_is_interrupted_and_its_finally_runs():
    ran_finally = threading.Event()

    def handler() -> None:
        try:
            spin(10)
        finally:
            ran_finally.set()

    clock, outcome, thread = run_in_thread(0.2, handler)
    time.sleep(0.3)
    assert clock.overdue(time.monotonic())
    assert clock.interrupt() and not clock.interrupt()  # once
    thread.join(5)
    assert not thread.is_alive() and ran_finally.is_set()
    [(value, raised)] = outcome
    assert value is None and isinstance(raised, TaskTimeout)
    assert str(clock.timeout_error) == "task exceeded its timeout of 0.2 s"


def test_a_run_that_returned_is_never_interrupted():
    clock, outcome, thread = run_in_thread(0.01, lambda: 42)
    thread.join(5)
    assert outcome == [(42, None)]
    assert not clock.overdue(time.monotonic() + 1) and not clock.interrupt()


def test_an_interrupt_racing_the_handlers_return_never_escapes_the_run():
    escaped: list[BaseException] = []
    for _ in range(200):
        clock = RunClock(0.0)

        def target(clock: RunClock = clock) -> None:
            try:
                call_with_clock(clock, lambda: sum(range(2000)))
                time.sleep(0.001)  # where a stray, late TaskTimeout would land
            except BaseException as exc:
                escaped.append(exc)

        thread = threading.Thread(target=target)
        clock.thread_id = 0
        thread.start()
        clock.thread_id = thread.ident or 0
        clock.interrupt()
        thread.join(5)
    assert escaped == []


def test_a_forced_cancel_raises_task_cancelled_whose_finally_runs_and_wins_over_a_return():
    ran_finally = threading.Event()

    def handler() -> str:
        try:
            spin(10)
        except TaskCancelled:
            return "swallowed it"
        finally:
            ran_finally.set()
        return "ran out"

    clock, outcome, thread = run_in_thread(60, handler)
    time.sleep(0.1)
    assert clock.force_cancel() and not clock.force_cancel() and not clock.interrupt()
    thread.join(5)
    assert not thread.is_alive() and ran_finally.is_set()
    [(value, raised)] = outcome
    assert value is None and raised is clock.cancel_error and isinstance(raised, TaskCancelled)
    assert not clock.overdue(time.monotonic() + 120)


def test_a_forced_run_still_going_after_the_grace_is_abandoned_once():
    clock = RunClock(None)
    assert not clock.abandon(0.0, time.monotonic())  # neither timed out nor cancelled
    clock.thread_id = 0  # no thread to raise in: it stands for one stuck in a C call
    assert clock.force_cancel()
    assert not clock.abandon(1.0, clock.interrupted_monotonic + 0.5)
    assert clock.abandon(1.0, clock.interrupted_monotonic + 1.0) and not clock.abandon(
        1.0, clock.interrupted_monotonic + 2
    )
    assert clock.abandoned


def test_a_run_that_returned_is_never_cancelled_by_force():
    clock, outcome, thread = run_in_thread(None, lambda: 42)
    thread.join(5)
    assert not clock.force_cancel() and outcome == [(42, None)] and clock.cancel_error is None


class LateClock(RunClock):
    """A clock whose timeout or forced cancel comes after the handler returned, just before `finish`."""

    def __init__(self, interrupt: str) -> None:
        super().__init__(timeout_s=60.0)
        self.late = interrupt

    def finish(self) -> None:
        if not self.returned:
            late = threading.Thread(target=getattr(self, self.late))  # from the time-limit or watch thread
            late.start()
            late.join(5)
        super().finish()


@pytest.mark.parametrize("interrupt", ["force_cancel", "interrupt"])
def test_a_cancel_or_timeout_coming_after_the_handler_returned_leaves_its_value(interrupt):
    clock = LateClock(interrupt)
    # Neither reported cancelled nor retried as timed out: the handler's work was all done.
    assert call_with_clock(clock, lambda: 42) == (42, None)
    assert clock.timeout_error is None and clock.cancel_error is None


@pytest.mark.parametrize("how", ["swallows the cancellation", "blocks the loop"])
def test_an_async_run_past_its_timeout_fails_for_it_even_if_it_returns(how):
    async def swallows() -> str:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            return "swallowed"
        return "slept"

    async def blocks() -> str:
        time.sleep(0.3)  # the point: the loop cannot cancel it
        return "blocked"

    handler = swallows if how == "swallows the cancellation" else blocks
    with pytest.raises(TaskTimeout):
        asyncio.run(within_timeout(handler(), 0.1))


def test_an_async_run_within_its_timeout_returns_its_value():
    async def quick() -> int:
        await asyncio.sleep(0.01)
        return 7

    assert asyncio.run(within_timeout(quick(), 5)) == 7
    assert asyncio.run(within_timeout(quick(), None)) == 7
