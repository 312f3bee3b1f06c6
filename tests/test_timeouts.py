"""Soft time limits: TaskTimeout raised in a running handler's thread, never after it returned."""

import threading
import time

from tasks_app.consumer.timeouts import RunClock, call_with_clock
from tasks_app.exceptions import TaskTimeout


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
            deadline = time.monotonic() + 10
            while True:
                if time.monotonic() >= deadline:
                    break
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
