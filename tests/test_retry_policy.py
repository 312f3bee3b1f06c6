"""Exponential backoff with jitter, and the retries a handler asks for."""

import random

import pytest
from django.test import override_settings

from tasks_app import PermanentError, Retry
from tasks_app.consumer.settling import MAX_BACKOFF_S, backoff_delay_s, retries_left, retry_delay_s


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


def test_a_retry_asked_for_waits_what_it_asked_not_the_backoff():
    assert retry_delay_s(Retry(in_s=42.5), attempt=9, base_s=2.0) == 42.5
    assert retry_delay_s(Retry(in_s=0), attempt=1, base_s=60.0) == 0.0
    assert 1.0 <= retry_delay_s(Retry(), attempt=1, base_s=2.0) <= 2.0, "no delay given: the backoff"


@override_settings(TASKS_MAX_DELAY_S=3600)
def test_a_retry_asked_for_past_the_longest_delay_waits_the_longest_delay():
    assert retry_delay_s(Retry(in_s=10**12), attempt=1, base_s=2.0) == 3600


@pytest.mark.parametrize("in_s", [-1, float("nan"), float("inf"), 10**400, True, "5", [5]])
def test_a_retry_delay_that_is_not_a_finite_number_of_seconds_is_refused_where_it_is_raised(in_s):
    with pytest.raises(ValueError, match="finite number of seconds"):
        Retry(in_s=in_s)


def test_a_permanent_error_leaves_its_attempts_unused():
    assert retries_left(ValueError(), attempt=1, max_attempts=3)
    assert not retries_left(ValueError(), attempt=3, max_attempts=3)
    assert not retries_left(PermanentError("bad card"), attempt=1, max_attempts=3)
    assert not retries_left(Retry(in_s=1), attempt=3, max_attempts=3), "a retry asked for still uses an attempt"
