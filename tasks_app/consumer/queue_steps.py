"""A loop's step done queue by queue: a queue whose keys Redis refuses (a foreign key's type) is its own problem."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from tasks_app import metrics
from tasks_app.problem_log import ProblemLog
from tasks_app.protocol.inspection import read_each

logger = logging.getLogger(__name__)


class QueueSteps:
    """Runs the steps of loop `loop` queue by queue; one Redis refused is counted, logged once, and skipped.

    An error that passes (Redis away, loading, failing over) is raised as before: it is no one queue's.
    """

    def __init__(self, loop: str) -> None:
        self.loop = loop
        self._problems: ProblemLog[tuple[str, str]] = ProblemLog(logger)

    def each[T](self, step: str, queues: Iterable[str], do: Callable[[str], T]) -> dict[str, T]:
        """`do(queue)` of each queue, by queue; the queues whose step Redis refused are left out."""
        done, refused = read_each(queues, do)
        for queue, error in refused.items():
            metrics.QUEUE_REFUSED.labels(self.loop, queue).inc()
            message = "%s: %s of queue %s refused by Redis (the others go on): %s"
            self._problems.failed((step, queue), error, message, self.loop, step, queue, error)
        for queue in done:
            self._problems.recovered((step, queue), "%s: %s of queue %s works again", self.loop, step, queue)
        return done
