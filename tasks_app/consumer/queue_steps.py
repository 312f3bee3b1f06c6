"""A loop's step done queue by queue: a queue whose keys Redis refuses (a foreign key's type) is its own problem."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from tasks_app import metrics
from tasks_app.problem_log import ProblemLog
from tasks_app.protocol.refusals import read_each

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
        queues = list(queues)
        done, refused = read_each(queues, do)
        self.note(step, queues, refused)
        return done

    def note(self, step: str, queues: Iterable[str], refused: Mapping[str, str]) -> None:
        """Count and say (once) each queue whose `step` Redis refused, with the error; say when one works again."""
        for queue in queues:
            if queue in refused:
                metrics.QUEUE_REFUSED.labels(self.loop, queue).inc()
                message = "%s: %s of queue %s refused by Redis (the others go on): %s"
                self._problems.failed((step, queue), refused[queue], message, self.loop, step, queue, refused[queue])
            else:
                self._problems.recovered((step, queue), "%s: %s of queue %s works again", self.loop, step, queue)

    def refused_queues(self) -> set[str]:
        """The queues one of whose steps Redis refused last time, until it works again."""
        return {queue for _, queue in self._problems.open_keys()}
