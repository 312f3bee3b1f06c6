"""An executor's async runs: a lane slot before the rate gate; a run dropped before it begins leaves nothing behind."""

from __future__ import annotations

import gc
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from tasks_app.consumer.async_lane import AsyncLane, LaneSeat
from tasks_app.consumer.executor import Executor
from tasks_app.consumer.gates import Admission
from tasks_app.protocol.codec import Task
from tasks_app.registry import Handler, Registry
from tasks_app.task_types import TaskTypeConfig
from tests.support.counters import sample
from tests.support.executing import claimed, delayed_tasks, make_executor, task_type
from tests.support.processes import wait_until
from tests.test_async_lane import Slots

pytestmark = pytest.mark.django_db

TASK_FUNCTION = "tests.support.django_tasks.async_add"
MISSED = "taskqueue_tasks_deferred_total"


class Lane:
    """A lane of `slots` slots and handlers to run there: `x.holds` blocks the loop until `free` is set."""

    def __init__(self, slots: int) -> None:
        self.free, self.waiting, self.began = threading.Event(), threading.Event(), threading.Event()
        self.lane = AsyncLane(slots, Slots())
        reserve = self.lane.reserve

        def noted_reserve() -> LaneSeat | None:
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
def lane(request: pytest.FixtureRequest) -> Iterator[Lane]:
    filled = Lane(getattr(request, "param", 1))  # one slot unless parametrized
    yield filled
    filled.free.set()
    filled.lane.close()


@pytest.fixture
def laned(broker, lane: Lane) -> Executor:
    return make_executor(broker, lane.handlers(), async_lane=lane.lane)


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
    wait_until(lambda: broker.records.get_result("t1")["status"] == "SUCCESSFUL", 5, message="t1 to succeed")
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


def never_awaited(caught: list[warnings.WarningMessage]) -> list[str]:
    """The "coroutine ... was never awaited" warnings caught so far, once every dropped coroutine is collected."""
    gc.collect()
    return [str(found.message) for found in caught if "never awaited" in str(found.message)]


@pytest.fixture
def caught() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as found:  # the whole process's: the lane's thread's too
        warnings.simplefilter("always")
        yield found


def run_on_the_lane(broker: Any, laned: Executor, task_id: str) -> None:
    """Run a task to its end on the lane: whatever the loop did before is done."""
    assert laned.execute(claimed(broker, task_id, "x.async_add", 1, 2)) is True
    wait_until(lambda: (broker.records.get_result(task_id) or {}).get("status") == "SUCCESSFUL", 5, message=task_id)


@pytest.mark.parametrize("lane", [2], indirect=True)
@pytest.mark.parametrize("handler", ["x.async_add", TASK_FUNCTION], ids=["handler", "task_function"])
def test_a_run_cancelled_with_force_before_it_begins_leaves_no_coroutine_unawaited(
    broker, lane, laned, caught, handler
):
    task_type(laned, "x.holds")
    task_type(laned, "x.async_add")
    task_type(laned, "x.cancelled", handler=handler)
    assert laned.execute(claimed(broker, "h1", "x.holds")) is True
    assert laned.execute(claimed(broker, "t1", "x.cancelled", 1, 2)) is True  # behind h1: it has not begun
    [run] = [run for run in laned.time_limits.running.values() if run.task.id == "t1"]
    run.context.control.force()  # what the time limits do on a forced cancel
    run.force_stop()
    lane.free.set()
    wait_until(lambda: broker.records.get_result("t1")["status"] == "CANCELLED", 5, message="t1 to be cancelled")
    run_on_the_lane(broker, laned, "t2")
    assert never_awaited(caught) == []


def test_a_run_stopped_after_its_start_was_written_leaves_no_coroutine_unawaited(broker, lane, laned, caught):
    task_type(laned, "x.async_add")
    checks = iter([True])

    def grace_ends_while_its_start_is_written(item: Any) -> bool:
        if next(checks, False) is False:
            laned.time_limits.starts_closed = True  # what interrupt_running sets as a stop's grace period ends
        return True

    laned.lease_check = grace_ends_while_its_start_is_written
    assert laned.execute(claimed(broker, "t1", "x.async_add", 1, 2)) is False
    assert broker.inspect.queue_stats("q").pending == 1  # back unstarted
    assert not lane.began.is_set() and never_awaited(caught) == []
