"""Retrying Redis calls through outages: log, back off, try again; deterministic errors surface."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable

from tasks_app import metrics
from tasks_app.problem_log import ProblemLog
from tasks_app.protocol.scripts import is_transient

logger = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
# Failures in a row, with Redis answering PING (a cluster serving every slot), after which a write
# is taken as refused: a cluster failing over answers PING yet refuses writes for seconds.
REFUSED_AFTER = 3
# Per `what`, the outage a retried call met, said by the first call to meet it and ended by the first one through.
_OUTAGES: ProblemLog[str] = ProblemLog(logger)


class GaveUp(Exception):
    """Redis stayed away until the caller was told to stop."""


class WriteRefused(Exception):
    """A write kept failing on the wire while Redis answered other commands: it is the write.

    Redis drops the connection of a command over its limits (a value over proto-max-bulk-len),
    which looks like an outage; retrying such a write would never end.
    """


def next_backoff_s(previous_s: float) -> float:
    """Double the previous wait, with jitter, capped at MAX_BACKOFF_S."""
    return min(MAX_BACKOFF_S, max(FIRST_BACKOFF_S, previous_s * 2)) * random.uniform(0.8, 1.2)


def redis_away(problems: ProblemLog[str], name: str, exc: BaseException, retry_s: float) -> float:
    """Count a Redis error of loop `name`, said once per outage (and as a reminder); return `retry_s`."""
    metrics.REDIS_ERRORS.labels(name).inc()
    problems.failed(name, "redis", "%s: redis error: %s; retrying in %.1f s", name, exc, retry_s)
    return retry_s


def until_done[T](
    call: Callable[[], T],
    *,
    what: str,
    give_up: threading.Event,
    refused_after: int = 0,
    redis_answers: Callable[[], bool] = lambda: False,
) -> T:
    """Run `call` until Redis accepts it; raise GaveUp once `give_up` is set.

    Only transient errors are retried: any other error (a ResponseError, an encoding error)
    would fail again the same way, so it is raised for the caller to settle. With
    `refused_after`, a call failing that many times in a row while `redis_answers()` raises
    WriteRefused.
    """
    backoff_s = 0.0
    failures = 0
    while True:
        try:
            result = call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            failures += 1
            if refused_after and failures >= refused_after and redis_answers():
                raise WriteRefused(f"{what} failed {failures} times while Redis answered: {exc}") from exc
            metrics.REDIS_ERRORS.labels(what).inc()
            backoff_s = next_backoff_s(backoff_s)
            _OUTAGES.failed(what, "redis", "redis error during %s: %s; retrying in %.1f s", what, exc, backoff_s)
            if give_up.wait(backoff_s):
                raise GaveUp(what) from exc
        else:
            if failures:
                _OUTAGES.recovered(what, "%s works again", what)
            return result
