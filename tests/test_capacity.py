"""A consumer's slots: a fixed prefetch, and the automatic one that follows the claim pace."""

import threading
import time

from prometheus_client import REGISTRY

from tasks_app.consumer.claiming import AUTO_PREFETCH_MAX, PREFETCH_HORIZON_S, Capacity


def test_capacity_counts_slots_up_to_its_limit():
    capacity = Capacity(2, 1)
    assert capacity.acquire(timeout_s=0) and capacity.acquire_up_to(5) == 2
    assert capacity.in_use == 3
    assert capacity.acquire_up_to(1) == 0 and not capacity.acquire(timeout_s=0.01)
    capacity.release(2)
    assert capacity.acquire_up_to(5) == 2 and capacity.in_use == 3


def test_capacity_ignores_empty_and_negative_requests():
    capacity = Capacity(1, 1)
    assert capacity.acquire_up_to(0) == 0 and capacity.acquire_up_to(-3) == 0
    capacity.release(0)
    capacity.release(-1)
    assert capacity.in_use == 0


def test_a_full_capacity_waits_for_a_release_from_another_thread():
    capacity = Capacity(1, 0)
    assert capacity.acquire(timeout_s=0)
    started = time.monotonic()
    threading.Timer(0.05, capacity.release).start()
    assert capacity.acquire(timeout_s=5)
    assert 0.04 <= time.monotonic() - started < 2
    assert capacity.in_use == 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def claim_at_pace(capacity: Capacity, clock: FakeClock, per_s: float, seconds: float) -> None:
    """Claim `per_s` tasks a second for `seconds` (in 10 ms steps of the fake clock)."""
    for _ in range(round(seconds * 100)):
        clock.now += 0.01
        capacity.acquire_up_to(0)
        capacity.claimed(round(per_s / 100))


def test_an_automatic_prefetch_starts_at_the_running_slots_and_grows_with_a_fast_pace():
    clock = FakeClock()
    capacity = Capacity(8, None, clock)
    assert capacity.limit == 8 and capacity.prefetch_max == AUTO_PREFETCH_MAX
    claim_at_pace(capacity, clock, per_s=5000, seconds=2)
    assert capacity.limit == 8 + AUTO_PREFETCH_MAX  # 5,000/s x 20 ms = 100, capped
    assert REGISTRY.get_sample_value("taskqueue_consumer_prefetch") == AUTO_PREFETCH_MAX
    claim_at_pace(capacity, clock, per_s=1000, seconds=2)
    assert capacity.limit == 8 + 1000 * PREFETCH_HORIZON_S


def test_an_automatic_prefetch_drops_to_nothing_for_slow_tasks_and_after_a_lull():
    clock = FakeClock()
    capacity = Capacity(4, None, clock)
    claim_at_pace(capacity, clock, per_s=5000, seconds=1)
    assert capacity.limit == 4 + AUTO_PREFETCH_MAX
    clock.now += 5  # idle: the next claim after a lull does not take a full prefetch
    assert capacity.acquire_up_to(100) == 4
    capacity.release(4)
    claim_at_pace(capacity, clock, per_s=20, seconds=3)  # 20/s x 20 ms < 1
    assert capacity.limit == 4


def test_a_fixed_prefetch_ignores_the_pace():
    clock = FakeClock()
    capacity = Capacity(2, 3, clock)
    assert REGISTRY.get_sample_value("taskqueue_consumer_prefetch") == 3
    claim_at_pace(capacity, clock, per_s=5000, seconds=1)
    assert capacity.limit == 5
    clock.now += 10
    assert capacity.acquire_up_to(100) == 5
