"""Burst mode: whether a consumer started with `--burst` has nothing left it may claim, so it exits.

A paused queue counts as idle: its pending and delayed tasks wait for a resume that a burst run
cannot wait for (as RQ's burst workers leave when suspended). So does a queue the consumer is not
registered on. Tasks in flight on any queue still keep it running, and so do the pending and
delayed tasks of every other queue.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence

from tasks_app.problem_log import ProblemLog
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.replies import QueueStats

logger = logging.getLogger(__name__)


def nothing_to_claim(broker: Broker, queues: Sequence[str], registered: Collection[str] | None = None) -> bool:
    """True once no queue has tasks in flight and only those it may not claim from have tasks waiting (logged).

    `registered`: the queues the consumer may claim from (None: all of them).
    """
    claimable = [queue for queue in queues if registered is None or queue in registered]
    stats = [broker.queue_stats(queue) for queue in queues]
    if any(s.processing or (s.queue in claimable and not s.paused and (s.pending or s.delayed)) for s in stats):
        return False
    for queue in stats:
        if queue.pending or queue.delayed:
            _say_left(queue)
    return True


def _say_left(queue: QueueStats) -> None:
    """Say that `queue`'s waiting tasks are left: it is paused, or this consumer cannot claim from it."""
    if queue.paused:
        logger.warning(
            "burst: queue %s is paused with %d task(s) pending and %d delayed; leaving them for a resume",
            queue.queue,
            queue.pending,
            queue.delayed,
        )
    else:
        logger.warning(
            "burst: queue %s has %d task(s) pending and %d delayed that this consumer cannot claim "
            "(it is not registered there); leaving them",
            queue.queue,
            queue.pending,
            queue.delayed,
        )


class IdleCheck:
    """`nothing_to_claim` as a burst consumer asks it at every tick: False while Redis is away, which is said once."""

    def __init__(
        self, broker: Broker, queues: Sequence[str], registered: Callable[[], Collection[str]] | None = None
    ) -> None:
        self.broker = broker
        self.queues = list(queues)
        self.registered = registered  # the queues the consumer may claim from now (None: all)
        self._problem: ProblemLog[str] = ProblemLog(logger)

    def __call__(self) -> bool:
        """True once the queues are idle (see `nothing_to_claim`); False if they cannot be checked."""
        try:
            registered = self.registered() if self.registered is not None else None
            idle = nothing_to_claim(self.broker, self.queues, registered)
        except Exception as exc:
            self._problem.failed("check", repr(exc), "burst: cannot check the queues: %s", exc)
            return False
        self._problem.recovered("check", "burst: the queues can be checked again")
        return idle
