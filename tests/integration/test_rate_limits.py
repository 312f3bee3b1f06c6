"""Rate limits across real consumer processes on real Redis, timed on the Redis clock."""

from __future__ import annotations

import time

import pytest

from tasks_app import producer
from tasks_app.consumer.gates import RatePolicy
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker
from tasks_app.task_types import TaskTypeConfig
from tests.support.ports import free_port
from tests.support.processes import wait_until
from tests.support.rate_decisions import admissions_ms, rate_decisions
from tests.support.recording import handler_starts, most_starts_in_any_window, recorded_runs
from tests.support.scrape import scrape

pytestmark = pytest.mark.django_db(transaction=True)

LIMITED = "test.record"
SYNC_START, ASYNC_START, BLOCK_LOOP = "test.handler_start", "test.async_handler_start", "test.block_loop"
DECISIONS = "taskqueue_rate_limit_decisions_total"
DEFERRED = "taskqueue_tasks_deferred_total"
YEAR_S = 365 * 86400


def redis_now_ms(broker: Broker) -> float:
    seconds, micros = broker.client.time()
    return seconds * 1000 + micros / 1000


def start_times_ms(broker: Broker, task_type: str) -> list[float]:
    return [run["start_ms"] for run in recorded_runs(broker) if run["type"] == task_type]


@pytest.mark.alone  # MONITOR slows every client of the server while it runs
def test_limit_holds_in_every_window_across_three_consumers(broker, consumer_process):
    TaskType.objects.create(name=LIMITED, handler=LIMITED, rate_limit=10, rate_period=1.0)
    ports = [free_port() for _ in range(3)]
    with rate_decisions(broker, LIMITED) as decided:
        consumers = [
            consumer_process("--concurrency", "8", "--lease", "2", "--metrics-port", str(port)) for port in ports
        ]
        wait_until(
            lambda: len(broker.inspect.queue_stats("default").consumers) == 3, 30, message="three consumers to register"
        )

        enqueued = producer.enqueue(LIMITED, count=200)
        wait_until(lambda: len(recorded_runs(broker)) >= 200, 40, interval_s=0.5, message="all 200 tasks to start")

    runs = recorded_runs(broker)
    assert sorted(run["task_id"] for run in runs) == sorted(task.id for task in enqueued)
    assert {run["attempt"] for run in runs} == {1}  # a denial never uses an attempt
    assert len({run["pid"] for run in runs}) == 3
    # The guarantee is on admissions (the decisions, on the Redis clock): a start follows its own
    # admission after a moment that load can stretch, so the windows are counted at the admissions.
    admitted = admissions_ms(decided)
    assert admitted.keys() == {run["task_id"] for run in runs}
    assert all(run["start_ms"] >= admitted[run["task_id"]] - 1 for run in runs)
    # GCRA keeps L + 1 admissions at least L*T - tau = W + sigma/2 apart (docs/PROTOCOL.md): checked
    # at that span, less 1 ms for MONITOR's stamp against the script's own TIME.
    policy = RatePolicy.for_config(TaskTypeConfig.from_model(TaskType.objects.get(name=LIMITED)))
    span_ms = (policy.limit * policy.emission_us - policy.tolerance_us) / 1000 - 1
    assert span_ms > 1000
    assert most_starts_in_any_window(list(admitted.values()), span_ms) <= 10
    assert max(admitted.values()) - min(admitted.values()) <= 20_000 * 1.25
    scrapes = [scrape(f"http://127.0.0.1:{port}/metrics") for port in ports]
    assert all(scrapes), [consumer.log() for consumer in consumers]
    allowed = sum(s.value(DECISIONS, type=LIMITED, decision="allowed") for s in scrapes)
    denied = sum(s.value(DECISIONS, type=LIMITED, decision="denied") for s in scrapes)
    # An admitted task whose handler could not begin within the start margin (a loaded machine) is
    # deferred unstarted and asks again: each admission is one start or one such deferral.
    missed = sum(s.value(DEFERRED, type=LIMITED, reason="rate_start_missed") for s in scrapes)
    assert allowed == 200 + missed, f"{allowed} admitted, {missed} missed their start, {denied} denied"
    assert allowed + denied == len(decided)
    assert (allowed + denied) / 200 <= 3


@pytest.mark.alone  # its start times are read at the handlers' first lines: load elsewhere would shift them
def test_handlers_start_within_every_limit_across_three_consumers_with_their_loops_blocked(broker, consumer_process):
    # A keyed limit on a sync handler, an unkeyed one on an async handler, and async handlers that
    # block the lanes' loops (a sync call inside `async def`): each admitted coroutine waits for
    # its loop, so its handler would begin long after its admission.
    TaskType.objects.create(name=SYNC_START, handler=SYNC_START, rate_limit=3, rate_period=1.0, rate_limit_key="tenant")
    TaskType.objects.create(name=ASYNC_START, handler=ASYNC_START, rate_limit=5, rate_period=1.0)
    TaskType.objects.create(name=BLOCK_LOOP, handler=BLOCK_LOOP)
    for _ in range(3):
        consumer_process("--concurrency", "4", "--lease", "2")
    wait_until(
        lambda: len(broker.inspect.queue_stats("default").consumers) == 3, 30, message="three consumers to register"
    )

    limited = [*producer.enqueue(SYNC_START, kwargs={"tenant": "a"}, count=12)]
    limited += producer.enqueue(SYNC_START, kwargs={"tenant": "b"}, count=12)
    limited += producer.enqueue(ASYNC_START, count=25)
    producer.enqueue(BLOCK_LOOP, kwargs={"sleep_s": 0.04}, count=150)
    wait_until(lambda: len(handler_starts(broker)) >= 49, 60, interval_s=0.5, message="every limited task to start")

    starts = handler_starts(broker)
    assert sorted(start["task_id"] for start in starts) == sorted(task.id for task in limited)  # each once
    assert {start["attempt"] for start in starts} == {1}  # a task sent back to wait used no attempt
    for limit, chosen in [
        (3, [start for start in starts if start.get("tenant") == "a"]),
        (3, [start for start in starts if start.get("tenant") == "b"]),
        (5, [start for start in starts if start["type"] == ASYNC_START]),
    ]:
        times = [start["start_ms"] for start in chosen]
        assert most_starts_in_any_window(times, 1000) <= limit, sorted(times)


def decisions(broker, policy: RatePolicy, type_name: str, count: int) -> list[int]:
    """Ask the rate limiter `count` times for one type; 0 means allowed."""
    return [
        broker.limits.rate_limit(
            type_name,
            policy.algorithm,
            f"{type_name}-{i}-{time.monotonic_ns()}",
            policy.limit,
            policy.period_us,
            policy.emission_us,
            policy.tolerance_us,
        ).wait_us
        for i in range(count)
    ]


def fresh_edge_policies() -> dict[str, RatePolicy]:
    """New type names: an attempt that missed its edge must not leave denials queued for the next."""
    suffix = time.monotonic_ns()
    return {
        f"edge.fixed.{suffix}": RatePolicy.for_config(
            TaskTypeConfig(name="f", handler="f", rate_limit=10, rate_algorithm="fixed_window")
        ),
        # GCRA with its largest burst: ten back to back is allowed, yet not ten more right after.
        f"edge.gcra.{suffix}": RatePolicy.for_config(
            TaskTypeConfig(name="g", handler="g", rate_limit=10, rate_burst=10)
        ),
    }


def test_fixed_window_admits_twice_the_limit_at_an_edge_where_gcra_does_not(broker):
    def straddle_an_edge() -> dict[str, list[int]]:
        """10 decisions per algorithm just before a whole second, 10 just after (Redis clock)."""
        policies = fresh_edge_policies()
        now_ms = redis_now_ms(broker)
        edge_ms = (now_ms // 1000 + 1) * 1000
        time.sleep(max(0.0, (edge_ms - 100 - now_ms) / 1000))
        before = {name: decisions(broker, policy, name, 10) for name, policy in policies.items()}
        if redis_now_ms(broker) >= edge_ms - 20:
            return {}
        time.sleep(max(0.0, (edge_ms + 20 - redis_now_ms(broker)) / 1000))
        after = {name: decisions(broker, policy, name, 10) for name, policy in policies.items()}
        return {name: before[name] + after[name] for name in policies}

    outcome = wait_until(straddle_an_edge, 10, interval_s=0, message="20 decisions straddling a window edge")
    fixed, gcra = outcome.values()  # type: ignore[union-attr]

    assert fixed.count(0) == 20  # all within ~140 ms: twice the limit
    assert gcra[:10] == [0] * 10
    assert gcra.count(0) == 10


@pytest.mark.alone  # its start times are read at the handler's first line: load elsewhere would shift them
def test_lowering_the_limit_takes_effect_within_five_seconds(broker, consumer_process):
    row = TaskType.objects.create(name=LIMITED, handler=LIMITED, rate_limit=10, rate_period=1.0)
    consumer_process("--concurrency", "4", "--lease", "2")
    producer.enqueue(LIMITED, count=80)
    wait_until(lambda: len(recorded_runs(broker)) >= 15, 30, message="the first tasks to run at 10 per second")

    row.rate_limit = 2
    row.save(update_fields=["rate_limit"])
    changed_ms = redis_now_ms(broker)
    wait_until(
        lambda: redis_now_ms(broker) >= changed_ms + 8000, 15, interval_s=0.2, message="eight seconds after the change"
    )

    starts = start_times_ms(broker, LIMITED)
    before = [t for t in starts if t < changed_ms]
    settled = [t for t in starts if changed_ms + 5000 <= t < changed_ms + 8000]
    assert most_starts_in_any_window(before, 1000) >= 8
    assert len(settled) >= 1 and most_starts_in_any_window(settled, 1000) <= 2


def test_throttled_type_does_not_block_an_unthrottled_one_behind_it(broker, consumer_process):
    TaskType.objects.create(name=LIMITED, handler=LIMITED, rate_limit=1, rate_period=60)
    TaskType.objects.create(name="test.free", handler=LIMITED)
    producer.enqueue(LIMITED, count=30)
    free = producer.enqueue("test.free", count=30)

    consumer_process("--concurrency", "2", "--prefetch", "2", "--lease", "2")
    wait_until(
        lambda: len(start_times_ms(broker, "test.free")) == 30,
        20,
        message="every unthrottled task to run while the throttled ones wait",
    )

    assert {run["task_id"] for run in recorded_runs(broker) if run["type"] == "test.free"} == {t.id for t in free}
    assert len(start_times_ms(broker, LIMITED)) == 1
    wait_until(
        lambda: broker.inspect.queue_stats("default").delayed == 29,
        5,
        message="the other throttled tasks to wait in the delayed set",
    )


def test_a_long_backlog_of_a_slow_type_keeps_getting_slots(broker):
    """1 a year with thousands waiting: slots reach millennia out, and the key's expiry follows them."""
    policy = RatePolicy.for_config(TaskTypeConfig(name="slow", handler="slow", rate_limit=1, rate_period_s=YEAR_S))
    args = (policy.algorithm, policy.limit, policy.period_us, policy.emission_us, policy.tolerance_us)
    waits = [broker.limits.rate_limit("slow", args[0], f"t{n}", *args[1:]).wait_us for n in range(4000)]
    assert waits[0] == 0 and waits == sorted(waits) and waits[-1] > 3500 * YEAR_S * 1_000_000
    assert broker.client.pttl(broker.keys.rate("slow")) > waits[-1] // 1000


@pytest.mark.parametrize("queue", ["default", "elsewhere"], ids=["own_queue", "another_queue"])
@pytest.mark.parametrize("new_limit", [100, None], ids=["raised", "removed"])
def test_raising_a_limit_brings_the_tasks_already_waiting_to_their_new_slots(
    broker, consumer_process, new_limit, queue
):
    # A limit set far too low by mistake: 1 per minute, with tasks already waiting minutes for slots,
    # on the type's own queue or on one the producer chose for them.
    row = TaskType.objects.create(name=LIMITED, handler=LIMITED, rate_limit=1, rate_period=60)
    consumer_process("--concurrency", "2", "--lease", "2", "--queue", queue)
    waiting = producer.enqueue(LIMITED, count=5, queue=queue)
    wait_until(lambda: broker.inspect.queue_stats(queue).delayed == 4, 15, message="four tasks to wait for slots")

    row.rate_limit, row.rate_period = new_limit, 1.0
    row.save(update_fields=["rate_limit", "rate_period"])
    # The consumer reads the change at its next refresh (TASKS_CONFIG_REFRESH_S = 2 s) and moves
    # the waiting slots then, with no new task of the type to decide on.
    wait_until(
        lambda: {run["task_id"] for run in recorded_runs(broker)} >= {t.id for t in waiting},
        10,
        message="every task to run at the new limit, not minutes apart",
    )
