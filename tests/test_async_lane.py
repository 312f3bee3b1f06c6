"""The asyncio lane on its own: slots handed over and back, outcomes settled once, blocked loops given up on."""

import asyncio
import threading
import time

from tasks_app.consumer.async_lane import AsyncLane
from tasks_app.exceptions import TaskTimeout


class Slots:
    def __init__(self) -> None:
        self.in_use = 1

    def hand_off(self) -> None:
        self.in_use -= 1

    def take_back(self) -> None:
        self.in_use += 1


def settled_runs(lane: AsyncLane, coroutine, timeout_s=None) -> tuple[list, threading.Event]:
    outcomes: list = []
    finished = threading.Event()

    def settle(value, error, raised, duration_s, on_settled) -> bool:
        outcomes.append((value, error))
        return False

    lane.submit(coroutine, settle, finished.set, timeout_s)
    return outcomes, finished


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
    assert lane.fail_hung(0.2) == 1 and lane.fail_hung(0.2) == 0
    assert finished.is_set() and lane.running == 0
    [(value, error)] = outcomes
    assert value is None and isinstance(error, TaskTimeout)
    time.sleep(1.0)
    assert len(outcomes) == 1, "its late end is not settled again"
    lane.close()
