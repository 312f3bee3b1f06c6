"""When a failed task runs again: exponential backoff with jitter, or the delay its handler asked for."""

import random

from django.conf import settings

from tasks_app.exceptions import PermanentError, Retry

MAX_BACKOFF_S = 3600.0
# The largest power of two a float holds: an envelope may allow far more attempts than that.
MAX_DOUBLINGS = 1023


def backoff_delay_s(attempt: int, base_s: float, rng: random.Random | None = None) -> float:
    """Return the wait before the run after failed run `attempt` (1-based).

    The ceiling doubles each attempt (base * 2^(attempt-1), capped at an hour); the wait is
    drawn uniformly from its upper half, so failures that happened together spread out.
    """
    ceiling = min(MAX_BACKOFF_S, base_s * 2.0 ** min(max(0, attempt - 1), MAX_DOUBLINGS))
    return (rng or random).uniform(ceiling / 2, ceiling)


def retries_left(error: BaseException, attempt: int, max_attempts: int) -> bool:
    """True if a run that failed with `error` on `attempt` runs again: attempts left, and the error not permanent."""
    return attempt < max_attempts and not isinstance(error, PermanentError)


def retry_delay_s(error: BaseException, attempt: int, base_s: float) -> float:
    """The wait before the next run: what a `Retry` asked for (at most TASKS_MAX_DELAY_S), else the backoff."""
    if isinstance(error, Retry) and error.in_s is not None:
        return min(error.in_s, float(settings.TASKS_MAX_DELAY_S))
    return backoff_delay_s(attempt, base_s)
