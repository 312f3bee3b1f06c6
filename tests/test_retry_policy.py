"""Exponential backoff with jitter."""

import random

from tasks_app.consumer.retry_policy import MAX_BACKOFF_S, backoff_delay_s


def test_backoff_doubles_and_stays_in_the_upper_half():
    rng = random.Random(7)
    for attempt, ceiling in [(1, 2.0), (2, 4.0), (3, 8.0), (4, 16.0)]:
        delays = [backoff_delay_s(attempt, 2.0, rng) for _ in range(200)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len({round(d, 6) for d in delays}) > 100, "jitter spreads retries"


def test_backoff_is_capped():
    assert backoff_delay_s(40, 10.0) <= MAX_BACKOFF_S


def test_zero_base_retries_at_once():
    assert backoff_delay_s(3, 0.0) == 0.0


def test_huge_attempt_counts_wait_the_cap_instead_of_overflowing():
    """A foreign envelope may allow millions of attempts: retry 2000 waits an hour, like retry 40."""
    for attempt in (1100, 2000, 2**31 - 1):
        assert MAX_BACKOFF_S / 2 <= backoff_delay_s(attempt, 2.0) <= MAX_BACKOFF_S
    assert backoff_delay_s(2**31 - 1, 0.0) == 0.0
