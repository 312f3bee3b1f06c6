"""Retrying Redis calls through outages: log, back off, try again."""
from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from typing import TypeVar

from redis.exceptions import RedisError

from . import metrics

logger = logging.getLogger(__name__)
T = TypeVar("T")

FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0


class GaveUp(Exception):
    """Redis stayed away until the caller was told to stop."""


def next_backoff_s(previous_s: float) -> float:
    """Double the previous wait, with jitter, capped at MAX_BACKOFF_S."""
    return min(MAX_BACKOFF_S, max(FIRST_BACKOFF_S, previous_s * 2)) * random.uniform(0.8, 1.2)


def until_done(call: Callable[[], T], *, what: str, give_up: threading.Event) -> T:
    """Run `call` until Redis accepts it; raise GaveUp once `give_up` is set."""
    backoff_s = 0.0
    while True:
        try:
            return call()
        except RedisError as exc:
            metrics.REDIS_ERRORS.labels(what).inc()
            backoff_s = next_backoff_s(backoff_s)
            logger.warning("redis error during %s: %s; retrying in %.1f s", what, exc, backoff_s)
            if give_up.wait(backoff_s):
                raise GaveUp(what) from exc
