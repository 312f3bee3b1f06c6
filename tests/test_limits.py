"""The rate-limit script and policy on fakeredis, with the server clock under the test's control."""

from __future__ import annotations

import itertools
import random
import threading
import time
import types
from typing import Any

import fakeredis
import pytest
from django.core.exceptions import ValidationError
from fakeredis.commands_mixins import server_mixin
from redis.exceptions import ConnectionError as RedisConnectionError

from tasks_app import metrics
from tasks_app.consumer.gates import MIN_START_MARGIN_US, RateLimiter, RatePolicy
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task
from tasks_app.protocol.limits import RateDecision
from tasks_app.task_types import TaskTypeConfig
from tests.support.recording import most_starts_in_any_window

START_US = 1_700_000_000_000_000
SECOND_US = 1_000_000
YEAR_S = 365 * 86400


class Clock:
    """The fake server clock read by the script's TIME, in microseconds."""

    def __init__(self) -> None:
        self.now_us = START_US

    def time(self) -> float:
        return self.now_us / SECOND_US


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(server_mixin, "time", types.SimpleNamespace(time=clock.time))
    return clock


@pytest.fixture
def broker() -> Broker:
    return Broker(fakeredis.FakeRedis(server=fakeredis.FakeServer()), "unit")


def config(limit: int, period_s: float = 1.0, burst: int = 1, algorithm: str = "gcra") -> TaskTypeConfig:
    return TaskTypeConfig(
        name="t", handler="t", rate_limit=limit, rate_period_s=period_s, rate_burst=burst, rate_algorithm=algorithm
    )


def decision(broker: Broker, policy: RatePolicy, task_id: str) -> RateDecision:
    """One decision on the fake clock."""
    return broker.limits.rate_limit(
        "t", policy.algorithm, task_id, policy.limit, policy.period_us, policy.emission_us, policy.tolerance_us
    )


def decide(broker: Broker, policy: RatePolicy, task_id: str) -> int:
    """One decision on the fake clock: 0 allowed, else microseconds to wait."""
    return decision(broker, policy, task_id).wait_us


# --- policy ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("limit", "period_s", "burst"),
    [(1, 1.0, 1), (10, 1.0, 1), (10, 1.0, 10), (7, 0.3, 3), (1, YEAR_S, 1), (1000, 60.0, 250), (10, 0.1, 1)],
)
def test_policy_keeps_every_window_within_the_limit_at_the_handlers_starts(limit, period_s, burst):
    policy = RatePolicy.for_config(config(limit, period_s, burst))

    # L + 1 admissions span W + the start margin: handlers that begin within it keep every window.
    assert limit * policy.emission_us - policy.tolerance_us >= policy.period_us + policy.start_margin_us
    assert policy.start_margin_us >= MIN_START_MARGIN_US
    assert 0 < policy.start_within_s * 1_000_000 < policy.start_margin_us
    # ... while losing at most 5% of the rate when there is no burst, unless the period is so short
    # that the shortest margin weighs more.
    if burst == 1 and period_s >= 0.2:
        assert policy.emission_us <= policy.period_us / limit * 1.05 + 1
    if burst == 1:
        assert policy.emission_us <= (policy.period_us * 1.05 + MIN_START_MARGIN_US) / limit + 1


def test_policy_refuses_a_type_without_a_limit():
    with pytest.raises(ValueError, match="has no rate limit"):
        RatePolicy.for_config(config(0))


# --- GCRA -----------------------------------------------------------------------------------
def test_limit_one_admits_one_then_reserves_the_next_slot(broker, clock):
    policy = RatePolicy.for_config(config(1))

    assert decide(broker, policy, "a") == 0
    wait_us = decide(broker, policy, "b")

    assert wait_us == policy.emission_us - policy.tolerance_us
    clock.now_us += wait_us - 1
    assert decide(broker, policy, "b") > 0  # one microsecond early: still denied


def test_clock_exactly_at_the_allowed_time_admits(broker, clock):
    policy = RatePolicy.for_config(config(1))
    assert decide(broker, policy, "a") == 0
    wait_us = decide(broker, policy, "b")

    clock.now_us += wait_us

    assert decide(broker, policy, "b") == 0
    assert decide(broker, policy, "c") == policy.emission_us


def test_very_long_period_keeps_exact_microseconds(broker, clock):
    policy = RatePolicy.for_config(config(1, period_s=YEAR_S))

    assert decide(broker, policy, "a") == 0
    wait_us = decide(broker, policy, "b")

    assert wait_us == policy.emission_us - policy.tolerance_us
    assert wait_us > YEAR_S * SECOND_US
    # The state outlives the reservation, so the year-long wait is still honoured.
    assert broker.client.pttl(broker.keys.rate("t")) > wait_us // 1000
    clock.now_us += wait_us
    assert decide(broker, policy, "b") == 0


def test_denied_tasks_get_slots_one_emission_interval_apart(broker, clock):
    policy = RatePolicy.for_config(config(10))
    assert decide(broker, policy, "first") == 0

    waits = [decide(broker, policy, f"t{i}") for i in range(5)]

    assert [b - a for a, b in itertools.pairwise(waits)] == [policy.emission_us] * 4


def test_a_newcomer_joins_the_queue_instead_of_taking_a_reserved_slot(broker, clock):
    policy = RatePolicy.for_config(config(10))
    decide(broker, policy, "first")
    waits = [decide(broker, policy, f"t{i}") for i in range(3)]

    clock.now_us += waits[0]
    newcomer_wait = decide(broker, policy, "newcomer")

    assert newcomer_wait == waits[2] - waits[0] + policy.emission_us
    assert decide(broker, policy, "t0") == 0


def test_burst_admits_back_to_back_then_spaces_starts(broker, clock):
    policy = RatePolicy.for_config(config(5, burst=3))

    assert [decide(broker, policy, f"t{i}") for i in range(3)] == [0, 0, 0]
    assert decide(broker, policy, "t3") > 0


@pytest.mark.parametrize(("limit", "period_s", "burst"), [(10, 1.0, 1), (5, 1.0, 3), (1, 0.5, 1), (4, 2.0, 4)])
def test_no_window_admits_more_than_the_limit(broker, clock, limit, period_s, burst):
    """Tasks arrive at random, and denied ones come back late by up to 100 ms."""
    policy = RatePolicy.for_config(config(limit, period_s, burst))
    rng = random.Random(limit * 1000 + burst)
    arrivals = sorted((START_US + rng.randrange(0, 3 * policy.period_us), f"t{i}") for i in range(60))
    starts: list[int] = []
    while arrivals:
        arrivals.sort()
        at_us, task_id = arrivals.pop(0)
        clock.now_us = max(clock.now_us, at_us)
        wait_us = decide(broker, policy, task_id)
        if wait_us:
            arrivals.append((clock.now_us + wait_us + rng.randrange(0, 100_000), task_id))
        else:
            starts.append(clock.now_us)

    assert len(starts) == 60
    assert most_starts_in_any_window(starts, policy.period_us) <= limit


# --- fixed window ---------------------------------------------------------------------------
def test_fixed_window_counts_per_clock_window(broker, clock):
    policy = RatePolicy.for_config(config(2, algorithm="fixed_window"))
    clock.now_us = START_US + SECOND_US // 2  # mid-window

    assert [decide(broker, policy, f"t{i}") for i in range(2)] == [0, 0]
    waits = [decide(broker, policy, f"d{i}") for i in range(3)]

    assert waits[0] == SECOND_US // 2  # the next window starts at the next whole second
    assert waits[1] - waits[0] == policy.emission_us


def test_fixed_window_admits_twice_the_limit_across_an_edge(broker, clock):
    policy = RatePolicy.for_config(config(3, algorithm="fixed_window"))
    clock.now_us = START_US + SECOND_US - 1000
    before = [decide(broker, policy, f"b{i}") for i in range(3)]
    clock.now_us += 2000
    after = [decide(broker, policy, f"a{i}") for i in range(3)]

    assert before + after == [0] * 6  # 2L starts within 2 ms: the documented weakness


def test_switching_algorithm_reuses_the_key(broker, clock):
    gcra = RatePolicy.for_config(config(2))
    fixed = RatePolicy.for_config(config(2, algorithm="fixed_window"))

    assert decide(broker, gcra, "a") == 0
    assert decide(broker, fixed, "b") == 0
    assert decide(broker, gcra, "c") > 0


def test_drained_queue_drops_forgotten_reservations(broker, clock):
    policy = RatePolicy.for_config(config(10))
    decide(broker, policy, "first")
    waits = [decide(broker, policy, f"gone{i}") for i in range(3)]

    clock.now_us += waits[-1] + policy.emission_us
    assert decide(broker, policy, "late") == 0

    assert sorted(broker.client.hkeys(broker.keys.rate("t"))) == [b"emission", b"tat"]


def test_a_raised_limit_brings_reserved_slots_closer_in_their_order(broker, clock):
    slow, fast = RatePolicy.for_config(config(1)), RatePolicy.for_config(config(10))
    decide(broker, slow, "first")
    waits = [decide(broker, slow, f"t{i}") for i in range(3)]
    assert waits[2] > 2 * SECOND_US

    newcomer = decision(broker, fast, "new")
    assert newcomer.rescaled, "the first decision under the new limit moves the slots"
    slots = [int(broker.client.hget(broker.keys.rate("t"), f"r:t{i}")) - clock.now_us for i in range(3)]
    assert slots == sorted(slots) and slots[2] < SECOND_US // 2, "the same order, at the new spacing"
    assert 0 < newcomer.wait_us - slots[2] <= fast.emission_us, "a newcomer still queues behind them"
    assert not decision(broker, fast, "next").rescaled, "moved once"


def test_a_task_back_before_its_slot_under_a_lowered_limit_keeps_its_place(broker, clock):
    fast, slow = RatePolicy.for_config(config(10)), RatePolicy.for_config(config(1))
    decide(broker, fast, "first")
    waits = [decide(broker, fast, f"t{i}") for i in range(3)]
    cursor = broker.client.hget(broker.keys.rate("t"), "cursor")

    clock.now_us += waits[0]  # t0 wakes at its old slot: under 1 per second its slot is later now
    wait_us = decide(broker, slow, "t0")
    assert wait_us > waits[0], "it waits for its moved slot"
    slot_us = int(broker.client.hget(broker.keys.rate("t"), "r:t0"))
    assert wait_us == slot_us - clock.now_us
    assert broker.client.hget(broker.keys.rate("t"), "cursor") > cursor, "the queue was spread out, once"
    cursor = broker.client.hget(broker.keys.rate("t"), "cursor")
    assert decide(broker, slow, "t0") == wait_us and broker.client.hget(broker.keys.rate("t"), "cursor") == cursor
    clock.now_us += wait_us
    assert decide(broker, slow, "t0") == 0


def test_bringing_a_hash_to_new_settings_decides_nothing_and_creates_no_hash(broker, clock):
    slow, fast = RatePolicy.for_config(config(1)), RatePolicy.for_config(config(10))
    assert decision(broker, fast, "") == (0, False) and not broker.client.exists(broker.keys.rate("t"))
    decide(broker, slow, "first")
    wait_us = decide(broker, slow, "t0")
    assert decision(broker, fast, "") == (0, True)
    assert decide(broker, fast, "t0") < wait_us and decision(broker, fast, "").rescaled is False


# --- the gate -------------------------------------------------------------------------------
def test_limiter_counts_decisions_and_rounds_the_wait_up_to_ms(broker, clock):
    limiter = RateLimiter(broker)
    cfg = config(limit=3, period_s=1.0)
    labels = {"type": "t", "decision": "denied"}
    denied_before = metrics.RATE_LIMIT_DECISIONS.labels(**labels)._value.get()

    admitted_at = time.monotonic()
    admission = limiter(Task(id="a", type="t"), cfg)
    wait_ms = limiter(Task(id="b", type="t"), cfg).wait_ms

    policy = RatePolicy.for_config(cfg)
    assert admission.wait_ms == 0  # its handler must begin within the start margin of the decision
    assert admitted_at < admission.start_by - policy.start_within_s < time.monotonic()
    assert wait_ms == -(-(policy.emission_us - policy.tolerance_us) // 1000)
    assert metrics.RATE_LIMIT_DECISIONS.labels(**labels)._value.get() == denied_before + 1


class FlakyBroker:
    """Fails the first decision like a Redis outage would, then answers."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.limits = self  # the only role the limiter asks of it
        self.calls = 0

    def rate_limit(self, *args: Any, **kwargs: Any) -> RateDecision:
        self.calls += 1
        if self.calls == 1:
            raise RedisConnectionError("connection refused")
        return self.broker.limits.rate_limit(*args, **kwargs)


def test_limiter_retries_through_a_redis_error(broker, clock, monkeypatch):
    monkeypatch.setattr("tasks_app.consumer.loops.FIRST_BACKOFF_S", 0.001)
    flaky = FlakyBroker(broker)
    limiter = RateLimiter(flaky, threading.Event())  # type: ignore[arg-type]

    assert limiter(Task(id="a", type="t"), config(1)).wait_ms == 0
    assert flaky.calls == 2


def test_a_burst_above_the_limit_is_rejected_with_the_numbers():
    row = TaskType(name="t", handler="t", rate_limit=3, rate_burst=5, rate_period=2.0)

    with pytest.raises(ValidationError) as raised:
        row.clean()

    assert raised.value.message_dict["rate_burst"] == [
        "The burst (5) cannot exceed the rate limit (3): at most 3 tasks may start in any 2-second window."
    ]


@pytest.mark.parametrize(
    ("period_s", "read_as_s"),
    [(1e300, YEAR_S), (float("inf"), YEAR_S), (float("nan"), YEAR_S), (0, 0.001), (-5, 0.001)],
)
def test_a_period_outside_the_admin_s_bounds_is_read_as_the_nearest_bound(broker, clock, period_s, read_as_s):
    # Written around the admin (`TaskType.objects.update(rate_period=...)`): no task may fail on it.
    policy = RatePolicy.for_config(config(1, period_s))
    assert policy == RatePolicy.for_config(config(1, read_as_s))
    assert decide(broker, policy, "a") == 0
    if read_as_s >= 1:  # a millisecond's period may be over before the next decision on a loaded machine
        assert decide(broker, policy, "b") > 0
