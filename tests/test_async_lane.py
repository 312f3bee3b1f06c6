"""The asyncio lane on its own: slots handed over and back, outcomes settled once, blocked loops given up on."""

import asyncio
import gc
import logging
import threading
import time

from tasks_app.consumer.async_lane import AsyncLane, Flight
from tasks_app.consumer.time_limits import RunClock
from tasks_app.exceptions import TaskCancelled, TaskTimeout


class Slots:
    def __init__(self) -> None:
        self.in_use = 1

    def release(self) -> None:
        self.in_use -= 1

    def take_back(self) -> None:
        self.in_use += 1


def recorded_flight(timeout_s=None) -> tuple[Flight, list]:
    """A flight whose settle records (value, error) in the list."""
    outcomes: list = []

    def settle(value, error, duration_s, on_settled, on_loop) -> bool:
        if on_loop:
            return False
        outcomes.append((value, error))
        return False

    return Flight(settle, RunClock(timeout_s)), outcomes


def submitted(lane: AsyncLane, coroutine, flight: Flight) -> threading.Event:
    """Submit the run; the event is set once it is settled."""
    finished = threading.Event()
    lane.submit(coroutine, flight, finished.set, lane.reserve())
    return finished


def settled_runs(lane: AsyncLane, coroutine, timeout_s=None) -> tuple[list, threading.Event]:
    flight, outcomes = recorded_flight(timeout_s)
    return outcomes, submitted(lane, coroutine, flight)


def test_a_coroutine_runs_on_the_loop_and_is_settled_once_with_its_slots_given_back():
    slots = Slots()
    lane = AsyncLane(10, slots)

    async def work() -> int:
        await asyncio.sleep(0.01)
        return 7

    outcomes, finished = settled_runs(lane, work())
    assert finished.wait(5)
    assert outcomes == [(7, None)] and lane.running == 0
    assert slots.in_use == 1, "handed off, then taken back just before on_settled releases it"
    lane.close()


def test_a_run_blocking_the_loop_past_its_hard_limit_is_failed_once():
    lane = AsyncLane(10, Slots())

    async def blocks_the_loop() -> str:
        time.sleep(1.0)  # a sync call inside async code: no cancellation can reach it
        return "late"

    flight, outcomes = recorded_flight(timeout_s=0.1)
    finished = submitted(lane, blocks_the_loop(), flight)
    time.sleep(0.4)
    clock = flight.clock
    assert clock.interrupt()  # what the time limits do at its timeout
    assert clock.abandon(0.2, time.monotonic()) and not clock.abandon(0.2, time.monotonic()), "given up on once"
    flight.settle_off_loop(None, clock.timeout_error, 0.4)
    assert finished.is_set() and lane.running == 0
    [(value, error)] = outcomes
    assert value is None and isinstance(error, TaskTimeout)
    time.sleep(1.0)
    assert len(outcomes) == 1, "its late end is not settled again"
    lane.close()


def test_a_forced_cancel_raises_task_cancelled_where_the_coroutine_awaits_and_wins_over_its_return():
    lane = AsyncLane(10, Slots())
    reached: list[str] = []

    async def swallows_the_cancel() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            reached.append("cancelled")
        return "went on"

    flight, outcomes = recorded_flight()
    finished = submitted(lane, swallows_the_cancel(), flight)
    time.sleep(0.1)
    flight.cancel()
    assert finished.wait(5) and reached == ["cancelled"]
    [(value, error)] = outcomes
    assert value is None and isinstance(error, TaskCancelled)
    lane.close()


def test_a_run_cancelled_with_force_before_it_began_never_begins():
    lane = AsyncLane(10, Slots())
    began = threading.Event()

    async def work() -> None:
        began.set()

    flight, outcomes = recorded_flight()
    flight.cancel()
    finished = submitted(lane, work(), flight)
    assert finished.wait(5) and not began.is_set()
    assert isinstance(outcomes[0][1], TaskCancelled)
    lane.close()


def test_a_forced_run_blocking_the_loop_past_the_grace_is_settled_cancelled_once():
    lane = AsyncLane(10, Slots())

    async def blocks_the_loop() -> str:
        time.sleep(1.0)
        return "late"

    flight, outcomes = recorded_flight()
    finished = submitted(lane, blocks_the_loop(), flight)
    time.sleep(0.1)
    flight.cancel()
    clock = flight.clock
    assert not clock.abandon(0.3, time.monotonic()), "within the grace"
    time.sleep(0.4)
    assert clock.abandon(0.3, time.monotonic()) and not clock.abandon(0.3, time.monotonic()), "given up on once"
    flight.settle_off_loop(None, clock.cancel_error, 0.5)
    assert finished.is_set() and isinstance(outcomes[0][1], TaskCancelled)
    time.sleep(1.0)
    assert len(outcomes) == 1, "its late end is not settled again"
    lane.close()


def test_a_system_exit_in_a_handler_s_own_asyncio_task_fails_that_run_and_the_lane_goes_on():
    lane = AsyncLane(10, Slots())

    async def exits() -> None:
        raise SystemExit(2)  # argparse's way out, in a task the handler spawned: asyncio re-raises it from the loop

    async def gathers() -> None:
        await asyncio.gather(exits())

    async def work() -> int:
        return 7

    outcomes, finished = settled_runs(lane, gathers())
    assert finished.wait(5)
    [(value, error)] = outcomes
    assert value is None and isinstance(error, SystemExit)
    outcomes, finished = settled_runs(lane, work())
    assert finished.wait(5) and outcomes == [(7, None)], "the loop still runs later tasks"
    lane.close()


def test_a_handler_that_stops_the_loop_still_ends_and_the_loop_runs_later_tasks(caplog):
    # Before: run_forever() returned to the lane's thread for good; no run ever began again.
    lane = AsyncLane(10, Slots())

    async def stops_the_loop() -> str:
        asyncio.get_running_loop().stop()
        await asyncio.sleep(0.01)
        return "went on"

    async def work() -> int:
        return 7

    outcomes, finished = settled_runs(lane, stops_the_loop())
    assert finished.wait(5) and outcomes == [("went on", None)]
    outcomes, finished = settled_runs(lane, work())
    assert finished.wait(5) and outcomes == [(7, None)], "the loop still runs later tasks"
    assert "stopped the asyncio lane's event loop" in caplog.text
    lane.close()


class ClosesTheLoopWhenStopped(logging.Handler):
    """On the lane's line about a stopped loop (logged from its thread, the loop not running): close that loop."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: asyncio.AbstractEventLoop | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.loop is not None and "stopped the asyncio lane's event loop" in record.getMessage():
            self.loop.close()  # what another thread of a handler could do just then


def test_a_loop_closed_by_a_handler_fails_the_runs_it_held_and_a_new_loop_runs_the_next():
    lane = AsyncLane(10, Slots())
    loops: list[asyncio.AbstractEventLoop] = []

    async def stops_the_loop() -> str:
        loops.append(asyncio.get_running_loop())
        closer.loop = loops[0]
        asyncio.get_running_loop().stop()
        await asyncio.sleep(0.01)
        return "went on"

    async def work() -> int:
        loops.append(asyncio.get_running_loop())
        return 7

    closer = ClosesTheLoopWhenStopped()
    logger = logging.getLogger("tasks_app.consumer.async_lane")
    logger.addHandler(closer)
    try:
        outcomes, finished = settled_runs(lane, stops_the_loop())
        assert finished.wait(5) and lane.running == 0, "settled: it can never go on"
    finally:
        logger.removeHandler(closer)
    [(value, error)] = outcomes
    assert value is None and isinstance(error, RuntimeError) and "closed" in str(error)
    outcomes, finished = settled_runs(lane, work())
    assert finished.wait(5) and outcomes == [(7, None)]
    assert loops[1] is not loops[0] and loops[0].is_closed()
    lane.close()


def test_whatever_else_a_handler_does_to_the_loop_fails_at_most_its_own_run():
    lane = AsyncLane(10, Slots())

    async def closes_the_running_loop() -> None:
        asyncio.get_running_loop().close()  # refused: the loop runs

    async def sets_another_loop() -> str:
        asyncio.set_event_loop(asyncio.new_event_loop())
        await asyncio.sleep(0.01)
        return "went on"

    async def sets_a_failing_task_factory() -> str:
        def fails(loop, coroutine, **kwargs):
            raise ValueError("no tasks here")

        asyncio.get_running_loop().set_task_factory(fails)
        return "set"

    async def work() -> int:
        return 7

    for hostile, expected in ((closes_the_running_loop, RuntimeError), (sets_another_loop, None)):
        outcomes, finished = settled_runs(lane, hostile())
        assert finished.wait(5)
        assert (type(outcomes[0][1]) if expected else outcomes[0][1]) == expected
    outcomes, finished = settled_runs(lane, sets_a_failing_task_factory())
    assert finished.wait(5) and outcomes == [("set", None)]
    outcomes, finished = settled_runs(lane, work())
    assert finished.wait(5), "a run the loop cannot start is settled"
    assert isinstance(outcomes[0][1], ValueError) and lane.running == 0
    lane.close()


def test_a_worker_waiting_for_a_slot_gives_up_once_the_consumer_stops():
    stopping = threading.Event()
    lane = AsyncLane(1, Slots(), stopping.is_set)
    taken = lane.reserve()
    assert taken is not None
    reserved: list = []
    waiter = threading.Thread(target=lambda: reserved.append(lane.reserve()))
    waiter.start()
    time.sleep(0.2)
    assert not reserved, "waits while the lane is full"
    stopping.set()
    waiter.join(5)
    assert reserved == [None], "no slot: its run must not start"
    taken.give_back()
    assert lane.reserve() is None, "nor does one that finds a slot once the stop began"
    stopping.clear()
    assert lane.reserve() is not None, "the slot was given back"


def test_closing_the_lane_cancels_the_runs_left_on_it_their_finally_blocks_run_and_none_is_left_pending(caplog):
    lane = AsyncLane(10, Slots())
    began, cleaned_up = threading.Event(), threading.Event()

    async def outlives_the_stop() -> None:
        began.set()
        try:
            await asyncio.sleep(60)
        finally:
            cleaned_up.set()

    flight, outcomes = recorded_flight()
    submitted(lane, outlives_the_stop(), flight)
    assert began.wait(5)
    assert flight.clock.give_up()  # what the time limits do at the end of a stop's grace
    flight.settle_off_loop(None, RuntimeError("given up on at the end of the grace"), 1.0)
    lane.close()
    assert cleaned_up.wait(5)
    assert [type(error) for _, error in outcomes] == [RuntimeError]  # settled once, by the stop
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        del lane, flight
        gc.collect()
    assert "Task was destroyed but it is pending" not in caplog.text
