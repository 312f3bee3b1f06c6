"""The executor's throttles in a real Redis: a slot per run, deferral and wake-up, paused queues, unique keys."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.tasks.signals import task_started
from redis.exceptions import ConnectionError as RedisConnectionError

from tasks_app.consumer.ack_batcher import AckBatcher
from tasks_app.consumer.async_lane import AsyncLane
from tasks_app.consumer.claiming import Claimed
from tasks_app.consumer.executor import Executor
from tasks_app.consumer.gates import Admission, ConcurrencyGate, RateLimiter, RatePolicy
from tasks_app.exceptions import TaskCancelled
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task, decode_task, encode_arguments, payload_of
from tasks_app.protocol.limits import SlotSet, Waiter
from tasks_app.registry import Handler
from tasks_app.task_types import TaskTypeCache, TaskTypeConfig
from tests.integration.test_rate_follow_ups import following
from tests.support.claims import claim, push, register, task_bytes
from tests.support.counters import sample
from tests.support.executing import executor_of, make_executor
from tests.support.processes import wait_until
from tests.test_async_lane import Slots
from tests.test_executor import (  # noqa: F401 (fixtures)
    CONSUMER,
    claimed,
    dead_tasks,
    delayed_tasks,
    executor,
    registry,
    task_type,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def gated(broker, registry) -> Executor:  # noqa: F811 (the fixture above)
    gate = ConcurrencyGate(broker, broker, lease_s=3, recheck_s=5, give_up=threading.Event())
    return make_executor(broker, registry, concurrency=gate)


def with_lane(broker: Broker, gated: Executor, lane: AsyncLane) -> Executor:
    """`gated`'s gates on a new executor that runs `async def` handlers on `lane`."""
    return executor_of(
        broker,
        gated.registry,
        CONSUMER,
        gated.task_types,
        rate_gate=gated.rate_gate,
        concurrency=gated.concurrency,
        async_lane=lane,
    )


def pending_ids(broker) -> list[str]:
    return [decode_task(raw).id for raw in broker.client.lrange(broker.keys.pending("q"), 0, -1)]


def test_a_run_holds_a_slot_and_gives_it_back(broker, gated):
    task_type(gated, "x.add", max_running=1)
    assert gated.execute(enqueued(broker, "t1", "x.add", 1, 2)) is True
    assert broker.records.get_result("t1")["status"] == "SUCCESSFUL"
    assert broker.client.zcard(broker.keys.running(*SlotSet("x.add", None, 1)[:2])) == 0


def test_no_free_slot_defers_without_an_attempt_and_a_freed_slot_wakes_the_task(broker, gated):
    task_type(gated, "x.add", max_running=1)
    slots = SlotSet("x.add", None, 1)
    assert broker.limits.acquire_slot(slots, "elsewhere", Waiter("q", b"+000other"), 3_000, 60_000)[0]
    assert gated.execute(enqueued(broker, "t1", "x.add", 1, 2)) is False
    [(task, due_in_ms)] = delayed_tasks(broker)
    assert task.id == "t1" and task.attempt == 0 and 2000 <= due_in_ms <= 5100  # only the fallback
    assert sample("taskqueue_tasks_deferred_total", type="x.add", queue="q", reason="max_running") >= 1

    woken = broker.limits.release_slot(slots, "elsewhere", 60_000, 3_000)
    assert [waiter.queue for waiter in woken] == ["q"]
    assert broker.limits.wake(woken[0]) and pending_ids(broker) == ["t1"] and delayed_tasks(broker) == []
    [raw] = claim(broker, CONSUMER, 1)
    assert gated.execute(Claimed("q", CONSUMER, raw)) is True
    assert broker.records.get_result("t1")["status"] == "SUCCESSFUL"  # the slot kept for it was its to take


def test_each_key_value_has_a_cap_of_its_own(broker, gated):
    task_type(gated, "x.kw", handler="x.context", max_running=1, max_running_key="tenant")
    assert broker.limits.acquire_slot(SlotSet("x.kw", "a", 1), "busy", Waiter("q", b"+000other"), 3_000, 60_000)[0]

    def run(task_id: str, tenant: str) -> None:
        raw = task_bytes(task_id, "x.kw", payload=payload_of(*encode_arguments([1, 2], {"tenant": tenant})))
        push(broker, raw)
        [taken] = claim(broker, CONSUMER, 1)
        gated.execute(Claimed("q", CONSUMER, taken))

    run("b1", "b")
    run("a1", "a")
    assert broker.records.get_result("b1")["status"] == "SUCCESSFUL"
    assert [task.id for task, _ in delayed_tasks(broker)] == ["a1"]


def test_a_task_of_a_queue_paused_after_its_claim_goes_back_unstarted(broker, gated):
    task_type(gated, "x.add")
    held = claimed(broker, "t1", "x.add", 1, 2)
    broker.control.pause("q")
    assert gated.execute(held) is False
    assert pending_ids(broker) == ["t1"] and broker.queue.held_by("q", CONSUMER) == []
    assert broker.records.get_result("t1") is None  # it never started


@pytest.mark.parametrize(
    ("handler", "payload", "error"),
    [
        ("x.nowhere", payload_of(*encode_arguments([], {})), "HandlerNotRegistered"),
        ("x.add", b"not json", "InvalidPayload"),
    ],
)
def test_a_unique_task_dead_lettered_unrun_frees_its_key(broker, gated, handler, payload, error):
    task_type(gated, "x.once", handler=handler, unique_for_s=600, unique_until="finished")
    unique_key = broker.keys.unique("q", "d1")
    broker.client.set(unique_key, "t1", px=600_000)  # as enqueue_unique left it
    gated.execute(claimed(broker, "t1", "x.once", raw=task_bytes("t1", "x.once", payload=payload, unique_digest="d1")))
    [dead] = dead_tasks(broker)
    assert dead.last_error.startswith(error)
    assert not broker.client.exists(unique_key)  # it failed for good: a new one may be enqueued


def test_a_waiter_without_an_enqueue_time_queues_behind_those_waiting_before_it(broker, gated):
    task_type(gated, "x.add", max_running=1)
    slots = SlotSet("x.add", None, 1)
    assert broker.limits.acquire_slot(slots, "elsewhere", Waiter("q", b"+000other"), 3_000, 60_000)[0]
    gated.execute(claimed(broker, "dated", "x.add", 1, 2, enqueued_at_ms=broker.inspect.server_time_ms() - 1000))
    gated.execute(claimed(broker, "foreign", "x.add", 1, 2))  # as a foreign producer pushes it: no enqueue time
    [woken] = broker.limits.release_slot(slots, "elsewhere", 60_000, 3_000)
    assert decode_task(woken.member[4:]).id == "dated"  # first come, first served


def held_unique_task(broker: Broker, task_type_name: str) -> tuple[Claimed, str]:
    """A claimed task holding the uniqueness key that its end frees (as enqueue_unique left it); the key."""
    unique_key = broker.keys.unique("q", "d1")
    broker.client.set(unique_key, "t1", px=600_000)
    return claimed(broker, "t1", task_type_name, raw=task_bytes("t1", task_type_name, unique_digest="d1")), unique_key


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("ending", ["succeeded", "failed", "cancelled"])
def test_the_late_end_of_a_run_whose_consumer_was_presumed_dead_keeps_the_key_of_its_rerun(
    broker,
    executor,  # noqa: F811 (the fixture)
    ending,
    batched,
):
    # While the handler runs, its consumer is presumed dead: its list is reaped, the task waits
    # to run again. The late run's end must leave the key to that re-run: a duplicate is refused.
    def presumed_dead_meanwhile() -> None:
        assert broker.leases.reap("q", CONSUMER, 30_000, own_earlier_run=True).requeued == 1
        if ending == "failed":
            raise ValueError("late failure")
        if ending == "cancelled":
            raise TaskCancelled("late cancel")

    executor.registry.add(Handler("x.late", presumed_dead_meanwhile))
    task_type(executor, "x.late", max_attempts=1, unique_for_s=600, unique_until="finished")
    if batched:
        executor = executor_of(
            broker,
            executor.registry,
            CONSUMER,
            executor.task_types,
            rate_gate=executor.rate_gate,
            acks=AckBatcher(broker, threading.Event()),
        )
    held, unique_key = held_unique_task(broker, "x.late")
    executor.execute(held)
    executor.settler.acks.close()
    # the re-run waits
    assert broker.inspect.queue_stats("q").pending == 1 and broker.queue.held_by("q", CONSUMER) == []
    assert broker.client.get(unique_key) == b"t1"


def test_a_unique_task_dead_lettered_as_a_last_resort_frees_its_key(broker, executor):  # noqa: F811 (the fixture)
    task_type(executor, "x.boom", max_attempts=3, unique_for_s=600, unique_until="finished")
    held, unique_key = held_unique_task(broker, "x.boom")
    broker.client.set(broker.keys.delayed("q"), "not a sorted set")  # its retry: WRONGTYPE, so settling fails
    executor.execute(held)
    broker.client.delete(broker.keys.delayed("q"))
    [dead] = dead_tasks(broker)
    assert dead.id == "t1" and "settling the task failed" in dead.dead_reason
    assert not broker.client.exists(unique_key)  # it failed for good: a new one may be enqueued


class LosesFirstReply:
    """A broker whose first acquire_slot runs in Redis but whose reply never arrives."""

    def __init__(self, broker: Broker) -> None:
        self.broker, self.lost = broker, False
        self.limits = self  # the only role the gate asks of it

    def acquire_slot(self, *args: Any) -> tuple[bool, list[Waiter]]:
        reply = self.broker.limits.acquire_slot(*args)
        if not self.lost:
            self.lost = True
            raise RedisConnectionError("reply lost")
        return reply


def test_a_slot_taken_by_a_call_whose_reply_was_lost_goes_to_its_retry(broker):
    gate = ConcurrencyGate(LosesFirstReply(broker), broker, lease_s=3, recheck_s=5, give_up=threading.Event())
    slots = SlotSet("x.add", None, 1)
    task = decode_task(task_bytes("t1", "x.add"))
    holder = gate.acquire(Claimed("q", CONSUMER, task_bytes("t1", "x.add")), task, slots)
    assert holder is not None  # the slot its first try took is its own, not a stranger's for a lease
    broker.limits.release_slot(slots, holder, 60_000, 3_000)
    assert broker.client.zcard(broker.keys.running(*slots[:2])) == 0


def test_the_unique_key_of_a_run_given_up_on_while_it_hangs_outlives_its_process(broker, gated):
    # Process mode: a handler stuck in C past its timeout and grace is failed while it still runs.
    task_type(
        gated, "x.stuck", handler="x.sleep", timeout=0.1, max_attempts=1, unique_for_s=600, unique_until="finished"
    )
    unique_key = broker.keys.unique("q", "d1")
    broker.client.set(unique_key, "t1", px=600_000)
    held = claimed(
        broker,
        "t1",
        "x.stuck",
        raw=task_bytes("t1", "x.stuck", payload=payload_of(*encode_arguments([1.5], {})), unique_digest="d1"),
    )
    run = threading.Thread(target=gated.execute, args=(held,))
    run.start()
    wait_until(lambda: gated.time_limits.expire_overdue() == 1, 5, interval_s=0.02, message="the timeout")
    wait_until(
        lambda: gated.time_limits.fail_hung(0.1, 5.0) == 1, 5, interval_s=0.02, message="the run to be given up on"
    )
    gated.time_limits.wait_hung_settled(timeout_s=10)  # settled on a thread of its own
    assert broker.records.get_result("t1")["status"] == "FAILED" and run.is_alive()
    assert 0 < broker.client.pttl(unique_key) <= 5000  # freed once its process is surely gone, not while it runs
    run.join()


async def blocks_the_loop(seconds: float) -> str:
    time.sleep(seconds)  # a sync call inside async code: no cancellation reaches it
    return "late"


def test_the_slot_of_an_async_run_given_up_on_while_it_hangs_is_held_until_its_process_is_gone(broker, gated):
    # Process mode: a run blocking its event loop past its timeout and grace is failed while it still runs.
    gated.registry.add(Handler("x.blocks", blocks_the_loop))
    gated = with_lane(broker, gated, AsyncLane(4, Slots()))
    task_type(gated, "x.hangs", handler="x.blocks", timeout=0.1, max_attempts=1, max_running=1)
    slots = SlotSet("x.hangs", None, 1)
    assert gated.execute(claimed(broker, "t1", "x.hangs", 1.5)) is True  # handed to the lane
    wait_until(lambda: gated.time_limits.expire_overdue() == 1, 5, interval_s=0.02, message="the timeout")
    wait_until(
        lambda: gated.time_limits.fail_hung(0.1, 5.0) == 1, 5, interval_s=0.02, message="the run to be given up on"
    )
    assert gated.time_limits.fail_hung(0.1, 5.0) == 0, "taken by one settling thread, not again at the next tick"
    wait_until(lambda: broker.records.get_result("t1")["status"] == "FAILED", 5, message="the run to be failed")
    # still running: its slot lapses with the lease once the process is gone
    assert broker.client.zcard(broker.keys.running(*slots[:2])) == 1
    gated.async_lane.close()


def test_a_task_denied_under_a_limit_removed_since_its_settings_were_read_is_due_now(broker, registry):  # noqa: F811
    register(broker, CONSUMER, lease_ms=30_000)
    types = TaskTypeCache()
    limiter = RateLimiter(broker, follows=types)

    def stale_gate(task: Task, config: TaskTypeConfig, key_token: str | None) -> Admission:
        # The refresh that finds the limit gone, and follows its removal up, runs between the
        # worker's read of the settings and its decision under them.
        TaskType.objects.filter(name="x.add").update(rate_limit=None)
        types.refresh()
        wait_until(lambda: not following(), 10, message="the removal to be followed up")
        return limiter(task, config, key_token)

    stale = executor_of(broker, registry, CONSUMER, types, rate_gate=stale_gate)
    task_type(stale, "x.add", rate_limit=1, rate_period=60)
    assert limiter(Task(id="first", type="x.add", queue="q"), types.get("x.add")).wait_ms == 0

    assert stale.execute(claimed(broker, "t1", "x.add", 1, 2)) is False

    [(task, due_in_ms)] = delayed_tasks(broker)
    assert task.id == "t1" and due_in_ms <= 0  # not at the slot the removed limit gave it


@pytest.mark.parametrize("changed", [{"rate_limit": None}, {"rate_limit": 2}], ids=["removed", "rescaled"])
def test_a_task_denied_just_before_another_consumer_follows_a_change_up_takes_its_new_slot(broker, registry, changed):  # noqa: F811
    register(broker, CONSUMER, lease_ms=30_000)
    types = TaskTypeCache()
    limiter = RateLimiter(broker, follows=types)

    def racing_gate(task: Task, config: TaskTypeConfig, key_token: str | None) -> Admission:
        # Another consumer follows the change up between this denial and its deferral's landing:
        # its scan of the delayed set cannot see the task yet.
        admission = limiter(task, config, key_token)
        RateLimiter(broker).follow(TaskTypeConfig(**{**vars(config), **changed}))
        wait_until(lambda: not following(), 10, message="the change to be followed up")
        return admission

    racing = executor_of(broker, registry, CONSUMER, types, rate_gate=racing_gate)
    task_type(racing, "x.add", rate_limit=1, rate_period=60)
    assert limiter(Task(id="first", type="x.add", queue="q"), types.get("x.add")).wait_ms == 0

    assert racing.execute(claimed(broker, "t1", "x.add", 1, 2)) is False
    TaskType.objects.filter(name="x.add").update(**changed)
    types.refresh()  # this consumer notices the change only now
    wait_until(lambda: not following(), 10, message="the change to be followed up")

    [(task, due_in_ms)] = delayed_tasks(broker)
    assert task.id == "t1" and due_in_ms <= (0 if changed["rate_limit"] is None else 31_000)


# --- a handler that cannot begin within its rate admission's start margin ---------------------
def start_margin_s(gated: Executor, type_name: str) -> float:
    return RatePolicy.for_config(gated.task_types.get(type_name)).start_margin_us / 1_000_000


def start_counts(type_name: str) -> list[float]:
    """The type's missed starts, starts and waits measured so far (in this process)."""
    labels = {"type": type_name, "queue": "q"}
    return [sample(DEFERRED, **labels, reason="rate_start_missed"), sample(STARTED, **labels), sample(WAITS, **labels)]


def enqueued(broker: Broker, task_id: str, type_name: str, *args: Any) -> Claimed:
    """A claimed task with an enqueue time: its start measures how long it waited."""
    return claimed(broker, task_id, type_name, *args, enqueued_at_ms=broker.inspect.server_time_ms())


def assert_waits_again_unstarted(broker: Broker, gated: Executor, task_id: str, before: list[float]) -> None:
    """The task waits in delayed, due at once, no attempt used, its record READY as before its start, unstarted."""
    [(task, due_in_ms)] = delayed_tasks(broker)
    assert task.id == task_id and task.attempt == 0 and due_in_ms <= 0  # its gate asks the limiter again
    record = broker.records.get_result(task_id)
    assert (record["status"], record["attempts"], record.get("started_at_ms", "")) == ("READY", "0", "")
    missed, started, waits = before
    assert start_counts(task.type) == [missed + 1, started, waits]
    minute = int(time.time()) // 60
    charted = [name for counts in broker.inspect.minute_counts("q", [minute - 1, minute]) for name in counts]
    assert [name for name in charted if task.type in name.split("|")] == []
    # The admission it missed stays spent: its window starts nothing else.
    config = gated.task_types.get(task.type)
    assert RateLimiter(broker)(Task(id="next", type=task.type, queue="q"), config).wait_ms > 0


DEFERRED = "taskqueue_tasks_deferred_total"
STARTED = "taskqueue_tasks_started_total"
WAITS = "taskqueue_task_wait_seconds_count"


@pytest.mark.parametrize("batched", [False, True], ids=["flushed_at_once", "batched"])
def test_a_handler_held_up_past_its_start_margin_waits_again_unstarted(broker, gated, batched):
    task_type(gated, "x.add", rate_limit=1, rate_period=1)
    if batched:
        gated = executor_of(
            broker,
            gated.registry,
            CONSUMER,
            gated.task_types,
            rate_gate=gated.rate_gate,
            concurrency=gated.concurrency,
            acks=AckBatcher(broker, threading.Event()),
        )
    held_up = iter([2 * start_margin_s(gated, "x.add")])
    # The worker is held up after its admission (descheduled, a slow write), the first time it checks its lease.
    gated.lease_check = lambda item: time.sleep(next(held_up, 0)) is None
    before = start_counts("x.add")

    assert gated.execute(enqueued(broker, "t1", "x.add", 1, 2)) is False
    gated.settler.acks.close()
    assert_waits_again_unstarted(broker, gated, "t1", before)


async def async_add(a: int, b: int) -> int:
    return a + b


def test_an_async_handler_its_loop_lets_begin_only_past_its_start_margin_waits_again_unstarted(broker, gated):
    gated.registry.add(Handler("x.blocks", blocks_the_loop))
    gated.registry.add(Handler("x.async_add", async_add))
    gated = with_lane(broker, gated, AsyncLane(4, Slots()))
    task_type(gated, "x.blocks")
    task_type(gated, "x.async_add", rate_limit=1, rate_period=1)
    before = start_counts("x.async_add")

    assert gated.execute(claimed(broker, "b1", "x.blocks", 4 * start_margin_s(gated, "x.async_add"))) is True
    assert gated.execute(enqueued(broker, "t1", "x.async_add", 1, 2)) is True  # admitted, its coroutine behind b1's
    wait_until(lambda: delayed_tasks(broker), 5, message="the task to wait again")
    wait_until(lambda: broker.records.get_result("b1")["status"] == "SUCCESSFUL", 5, message="the blocking run to end")
    assert_waits_again_unstarted(broker, gated, "t1", before)


def test_a_task_function_held_up_past_its_start_margin_waits_again_without_task_started(broker, gated):
    path = "tests.support.django_tasks.add"
    task_type(gated, "x.task_add", handler=path, rate_limit=1, rate_period=1)
    held_up = iter([2 * start_margin_s(gated, "x.task_add")])
    gated.lease_check = lambda item: time.sleep(next(held_up, 0)) is None
    started: list[str] = []

    def on_started(sender: type, task_result: Any, **kwargs: Any) -> None:
        started.append(task_result.id)

    before = start_counts("x.task_add")
    task_started.connect(on_started)
    try:
        assert gated.execute(enqueued(broker, "t1", "x.task_add", 1, 2)) is False
    finally:
        task_started.disconnect(on_started)
    assert started == []  # nothing of the run began, not even its signal
    assert_waits_again_unstarted(broker, gated, "t1", before)
