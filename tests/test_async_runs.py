"""An executor's async runs: a lane slot before the rate gate."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tasks_app.consumer.async_lane import AsyncLane, LaneSlot
from tasks_app.consumer.executor import Executor
from tasks_app.consumer.limits import Admission
from tasks_app.protocol.codec import Task
from tasks_app.registry import Handler, Registry
from tasks_app.task_types import TaskTypeConfig
from tests.support.counters import sample
from tests.support.executing import claimed, delayed_tasks, make_executor, task_type
from tests.support.processes import wait_until
from tests.test_async_lane import Slots

pytestmark = pytest.mark.django_db

MISSED = "taskqueue_tasks_deferred_total"


class Lane:
    """A lane of one slot and the handlers to fill it: `x.holds` holds the loop until `free` is set."""

    def __init__(self) -> None:
        self.free, self.waiting, self.began = threading.Event(), threading.Event(), threading.Event()
        self.lane = AsyncLane(1, Slots())
        reserve = self.lane.reserve

        def noted_reserve() -> LaneSlot | None:
            self.waiting.set()  # a worker asks for a slot (it waits while the lane is full)
            return reserve()

        self.lane.reserve = noted_reserve  # type: ignore[method-assign]

    def handlers(self) -> Registry:
        registry = Registry()
        registry.add(Handler("x.holds", self.holds))
        registry.add(Handler("x.async_add", self.add))
        return registry

    async def holds(self) -> None:
        self.free.wait(10)  # blocks the loop: nothing else begins on the lane meanwhile

    async def add(self, a: int, b: int) -> int:
        self.began.set()
        return a + b


@pytest.fixture
def lane() -> Iterator[Lane]:
    filled = Lane()
    yield filled
    filled.free.set()
    filled.lane.close()


@pytest.fixture
def laned(broker, lane: Lane) -> Executor:
    executor = make_executor(broker, lane.handlers())
    executor.async_lane = lane.lane
    return executor


def test_a_rate_limited_async_task_waiting_for_a_full_lane_is_admitted_only_once_it_can_begin(broker, lane, laned):
    task_type(laned, "x.holds")
    task_type(laned, "x.async_add", rate_limit=1, rate_period=60)
    limiter, admitted = laned.rate_gate, []
    assert limiter is not None
    missed_before = sample(MISSED, type="x.async_add", reason="rate_start_missed")

    def gate(task: Task, config: TaskTypeConfig, key_token: str | None) -> Admission:
        # Its start margin widened, so that only the wait for the lane can make it miss its start.
        admission = limiter(task, config, key_token)
        if admission.wait_ms == 0:
            admitted.append(task.id)
            return admission._replace(start_by=admission.start_by + 0.5)
        return admission

    laned.rate_gate = gate
    assert laned.execute(claimed(broker, "h1", "x.holds")) is True  # fills the lane
    lane.waiting.clear()
    worker = threading.Thread(target=laned.execute, args=(claimed(broker, "t1", "x.async_add", 1, 2),))
    worker.start()
    assert lane.waiting.wait(5)
    time.sleep(1.0)  # the lane stays full for longer than the widened margin
    lane.free.set()
    worker.join(5)
    wait_until(lambda: lane.began.is_set() or delayed_tasks(broker), 5, message="t1 to begin or wait again")
    assert admitted == ["t1"] and lane.began.is_set(), "its admission was spent while it waited for the lane"
    wait_until(lambda: broker.get_result("t1")["status"] == "SUCCESSFUL", 5, message="t1 to succeed")
    assert sample(MISSED, type="x.async_add", reason="rate_start_missed") == missed_before


def test_a_rate_limited_async_task_deferred_gives_its_lane_slot_back(broker, lane, laned):
    task_type(laned, "x.async_add", rate_limit=1, rate_period=60)
    laned.rate_gate = lambda task, config, key_token: Admission(60_000)  # denied
    assert laned.execute(claimed(broker, "t1", "x.async_add", 1, 2)) is False
    [(task, _)] = delayed_tasks(broker)
    assert task.id == "t1"
    deadline = time.monotonic() + 5
    lane.lane.stopping = lambda: time.monotonic() > deadline  # a slot not given back: None after 5 s
    assert lane.lane.reserve() is not None
