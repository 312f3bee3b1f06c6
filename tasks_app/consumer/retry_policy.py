"""When a failed task runs again: exponential backoff with jitter."""

import random

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
