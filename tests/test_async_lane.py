"""The asyncio lane on its own: slots handed over and back, outcomes settled once, blocked loops given up on."""

import asyncio
import threading
import time

from tasks_app.consumer.async_lane import AsyncLane, Flight
from tasks_app.exceptions import TaskCancelled, TaskTimeout


class Slots:
    def __init__(self) -> None:
        self.in_use = 1

    def hand_off(self) -> None:
        self.in_use -= 1

    def take_back(self) -> None:
        self.in_use += 1


def recorded_flight(timeout_s=None) -> tuple[Flight, list]:
    """A flight whose settle records (value, error) in the list."""
    outcomes: list = []

    def settle(value, error, raised, duration_s, on_settled) -> bool:
        outcomes.append((value, error))
        return False

    return Flight(settle, timeout_s), outcomes


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

    outcomes, finished = settled_runs(lane, blocks_the_loop(), timeout_s=0.1)
    time.sleep(0.4)
    hung = lane.take_hung(0.2)
    assert len(hung) == 1 and lane.take_hung(0.2) == [], "taken once"
    lane.settle_hung(hung, 0.2)
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
    lane.cancel(flight)
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
    lane.cancel(flight)
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
    lane.cancel(flight)
    assert lane.take_hung(0.3) == [], "within the grace"
    time.sleep(0.4)
    hung = lane.take_hung(0.3)
    assert len(hung) == 1 and lane.take_hung(0.3) == [], "given up on once"
    lane.settle_hung(hung, 0.3)
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
